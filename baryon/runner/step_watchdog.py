"""The step watchdog of a multi-GPU engine: a step that has not finished `watchdog_timeout`
seconds after the engine began waiting for it fails the engine instead of hanging it.

A rank of a tensor-parallel engine, or a DP-attention replica, can wait on the device for a peer
that never comes: inside the fused all-reduce's kernels (which give up by themselves only after
2^25 reads, ~35 s, or 2^31 for DP exchanges, more than half an hour), in an NCCL collective
(30 minutes), or behind a kernel that does not end. Rank 0's thread waits for each step's event
by polling (`LaunchedStep._wait`) and asks the watchdog every few milliseconds. Past the timeout
the watchdog logs how long the step has waited, has every rank print its Python stacks (this
process's to stderr, SIGUSR1 to the workers), releases the kernels' waits (their abort word) and
aborts the process group (NCCL's), and raises StepTimeoutError: the engine fails as it does when
a worker dies (offline: the exception; the server: 503s and an unhealthy /health), and a
supervisor can restart it. Single-GPU engines wait on nothing but their own kernels and block in
`Event.synchronize` without a watchdog.
"""

from __future__ import annotations

import time

from baryon.distributed.parallel_state import abort_distributed, release_waits
from baryon.distributed.worker_group import WorkerGroup
from baryon.logger import dump_stacks, get_logger

logger = get_logger(__name__)

_STACKS_GRACE_S = 0.5  # lets the workers print their stacks before their waits are released


class StepTimeoutError(RuntimeError):
    """A step of a multi-GPU engine did not finish within watchdog_timeout seconds."""


class StepWatchdog:
    def __init__(self, timeout_s: float, workers: WorkerGroup | None) -> None:
        self.timeout_s = timeout_s
        self.workers = workers  # this engine's tensor-parallel workers (None: a DP-attention replica alone)

    def check(self, waited_s: float) -> None:
        """Called while a step is waited for: raise WorkerDiedError if a worker has died, and
        StepTimeoutError (after dumping stacks and releasing every wait) once the step has been
        waited for longer than the timeout."""
        if self.workers is not None:
            self.workers.check()
        if waited_s <= self.timeout_s:
            return
        message = (f"a step did not finish within watchdog_timeout={self.timeout_s:g} s: a rank is waiting on the "
                   f"device for a peer that does not come, or a kernel does not end; every rank's stacks are in "
                   f"the log, and the engine stops (raise --watchdog-timeout if steps this long are expected)")
        logger.error(message)
        if self.workers is not None:
            self.workers.dump_stacks()
        dump_stacks()
        time.sleep(_STACKS_GRACE_S)
        release_waits()
        abort_distributed()
        raise StepTimeoutError(message)
