"""The worker processes of a tensor-parallel engine: ranks 1 .. world_size - 1.

Rank 0 is the engine's own process. `WorkerGroup.start` launches each other rank as
`python -m baryon.runner.worker` (the pickled EngineConfig on its stdin), joins the process group
with them as rank 0, and keeps one ZMQ PUSH socket per worker for the step plans. Every rank then
builds the same ModelRunner (each loading only its shards), profiles memory, and captures CUDA
graphs in step; afterwards the workers run whatever plan rank 0 sends.

A monitor thread watches the workers: one that exits makes `failure` say which and how, aborts
the process group (so that no collective waits for it), and `check()` raises WorkerDiedError, so
the engine fails within a fraction of a second instead of hanging. `shutdown()` (also run at
interpreter exit) stops every worker.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import zmq

from baryon.config import free_port
from baryon.distributed.parallel_state import abort_distributed, destroy_distributed, init_distributed, release_waits
from baryon.logger import get_logger

logger = get_logger(__name__)

# The frames rank 0 sends: a step's plan to run, the requests to draft for (speculative decoding
# with a draft model, EAGLE-3 or MTP: runner/propose_plan.py), or the end.
STEP, PROPOSE, STOP = b"step", b"propose", b"stop"
_MONITOR_INTERVAL_S = 0.05
_START_FAILURE_WAIT_S = 15.0  # after a failed join, how long a worker's exit is awaited
_SHUTDOWN_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process of a tensor-parallel engine exited; the engine cannot continue."""


def _failure_path(step_address: str) -> str:
    """Where the worker pulling steps from `step_address` (ipc://PATH) leaves its error."""
    return step_address.removeprefix("ipc://") + ".error"


def report_failure(step_address: str, error: Exception) -> None:
    """A worker's last act when it fails: its exception, for rank 0 to raise in its name (the
    same problem on every rank, a checkpoint rank 0 has not reached yet, must not surface on rank
    0 as the process group it aborted on seeing the worker exit)."""
    try:
        with open(_failure_path(step_address), "wb") as f:
            pickle.dump((type(error).__name__, str(error)), f)
    except OSError:
        pass


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class WorkerGroup:
    def __init__(self, socket_dir: str) -> None:
        self._socket_dir = socket_dir
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self.processes: list[subprocess.Popen] = []
        self.failure: str | None = None
        self.worker_error: tuple[str, str] | None = None  # (type, message) a failed worker reported
        self._stopping = False
        self._monitor: threading.Thread | None = None

    @classmethod
    def start(cls, config, world_size: int, expert_parallel: bool) -> WorkerGroup:
        """Launch ranks 1 .. world_size - 1 and join the process group as rank 0 (returns once
        every rank has joined)."""
        group = cls(tempfile.mkdtemp(prefix="baryon-workers-"))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        payload = pickle.dumps(config)
        try:
            for rank in range(1, world_size):
                address = group._step_address(rank)
                sock = group._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.bind(address)
                group._sockets.append(sock)
                process = subprocess.Popen(
                    [sys.executable, "-m", "baryon.runner.worker", str(rank), str(world_size), init_method, address,
                     str(os.getpid())], stdin=subprocess.PIPE)
                group.processes.append(process)
                try:
                    process.stdin.write(payload)
                    process.stdin.close()
                except BrokenPipeError:  # it exited before reading its config: the monitor names it
                    pass
            group._monitor = threading.Thread(target=group._watch, name="baryon-worker-monitor", daemon=True)
            group._monitor.start()
            atexit.register(group.shutdown)
            if config.device.type == "cuda" and config.device.index is not None:
                torch.cuda.set_device(config.device)  # a data-parallel replica's rank 0 is not on cuda:0
            init_distributed(world_size, 0, init_method, backend_for(config.device), expert_parallel,
                             config.model.dtype)
        except BaseException as e:
            try:
                # The join failed: a worker that died is the reason to give. One that refused the
                # configuration may still be on its way out (importing torch takes seconds on a busy
                # host: CI saw the join's timeout first), so wait a while for it.
                if isinstance(e, Exception):
                    group.check(wait_s=_START_FAILURE_WAIT_S, starting=True)
            finally:
                group.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (workers: pids %s)", world_size,
                    [p.pid for p in group.processes])
        return group

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in enumerate(self.processes, 1):
                code = process.poll()
                if code is not None and not self._stopping:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self.worker_error = self._reported_error(rank)
                    why = (f": {self.worker_error[0]}: {self.worker_error[1]}" if self.worker_error else
                           " (its log above says why, if it failed itself)")
                    self.failure = (f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}; the engine "
                                    f"cannot continue without it{why}")
                    logger.error(self.failure)
                    release_waits()
                    abort_distributed()
                    return
            time.sleep(_MONITOR_INTERVAL_S)

    def _step_address(self, rank: int) -> str:
        """The ZMQ address rank `rank` pulls its step plans from."""
        return f"ipc://{self._socket_dir}/rank{rank}"

    def _reported_error(self, rank: int) -> tuple[str, str] | None:
        """(exception type, message) a worker that failed left behind (`report_failure`), if any."""
        try:
            with open(_failure_path(self._step_address(rank)), "rb") as f:
                return pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError):
            return None

    def check(self, wait_s: float = 0.0, starting: bool = False) -> None:
        """Raise WorkerDiedError if a worker has exited (waiting up to wait_s for the monitor to
        notice one: after a collective failed, the death is usually a moment from being seen).
        starting: the engine is starting, and a worker that refused the configuration with a
        ValueError has it raised here as one rank would raise it."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(_MONITOR_INTERVAL_S / 2)
        if self.failure is None:
            return
        if starting and self.worker_error is not None and self.worker_error[0] == "ValueError":
            raise ValueError(self.worker_error[1])
        raise WorkerDiedError(self.failure)

    def dump_stacks(self) -> None:
        """Every live worker prints its threads' Python stacks to stderr (SIGUSR1)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGUSR1)

    def send_step(self, payload: bytes) -> None:
        for sock in self._sockets:
            sock.send_multipart((STEP, payload), copy=False)

    def send_propose(self, payload: bytes) -> None:
        for sock in self._sockets:
            sock.send_multipart((PROPOSE, payload), copy=False)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group."""
        if self._stopping:
            return
        self._stopping = True
        for sock in self._sockets:
            try:
                sock.send_multipart((STOP, b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
        for sock in self._sockets:
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        try:
            destroy_distributed()
        except Exception:  # already aborted after a worker died
            pass
        atexit.unregister(self.shutdown)
