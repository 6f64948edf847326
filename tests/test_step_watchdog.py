"""The multi-GPU step watchdog (baryon/runner/step_watchdog.py), on CPU: a step whose event never
completes fails with StepTimeoutError once waited for longer than the timeout, after every rank's
stacks were asked for and every wait released; a step that completes in time, and a worker that
died, behave as before."""

from __future__ import annotations

import random
import time

import pytest

from baryon.distributed.worker_group import WorkerDiedError
from baryon.runner import step_watchdog
from baryon.runner.model_runner import LaunchedStep
from baryon.runner.step_watchdog import StepTimeoutError, StepWatchdog


class _Event:
    """A CUDA event's query(): done after `polls` queries (None: never)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.queries = polls, 0

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


class _Workers:
    def __init__(self, failure: str | None = None) -> None:
        self.failure, self.checks, self.dumps = failure, 0, 0

    def check(self) -> None:
        self.checks += 1
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def dump_stacks(self) -> None:
        self.dumps += 1


@pytest.fixture
def released(monkeypatch):
    """What the watchdog released: the kernels' waits and the process group."""
    calls = []
    monkeypatch.setattr(step_watchdog, "release_waits", lambda: calls.append("waits"))
    monkeypatch.setattr(step_watchdog, "abort_distributed", lambda: calls.append("group"))
    monkeypatch.setattr(step_watchdog, "_STACKS_GRACE_S", 0.0)
    return calls


def _step(event: _Event, watchdog: StepWatchdog) -> LaunchedStep:
    step = LaunchedStep(["a"], watchdog)
    step._event = event
    return step


@pytest.mark.parametrize("with_workers", [False, True])
def test_a_hung_step_fails_after_the_timeout(released, capfd, with_workers, seed):
    timeout = random.Random(seed).uniform(0.05, 0.15)
    workers = _Workers() if with_workers else None
    event = _Event(None)
    start = time.monotonic()
    with pytest.raises(StepTimeoutError, match="watchdog_timeout"):
        _step(event, StepWatchdog(timeout, workers))._wait()
    waited = time.monotonic() - start
    assert timeout <= waited < timeout + 2.0
    assert event.queries > 1  # it polled, not blocked
    assert released == ["waits", "group"]
    assert "most recent call first" in capfd.readouterr().err  # this process's stacks
    if workers is not None:
        assert workers.dumps == 1 and workers.checks >= 1


def test_a_step_that_ends_in_time_is_not_touched(released):
    workers = _Workers()
    event = _Event(random.randint(3, 30))
    _step(event, StepWatchdog(30.0, workers))._wait()
    assert released == [] and workers.dumps == 0
    assert event.queries == event.polls + 1


def test_a_dead_worker_is_reported_before_the_timeout(released):
    workers = _Workers("tensor-parallel worker rank 1 (pid 7) was killed by signal 9")
    with pytest.raises(WorkerDiedError, match="rank 1"):
        _step(_Event(None), StepWatchdog(30.0, workers))._wait()
    assert released == [] and workers.dumps == 0
