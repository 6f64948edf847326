"""The package logger: `baryon` messages go to stderr at INFO unless BARYON_LOG_LEVEL says otherwise."""

import faulthandler
import io
import logging
import os
import signal
import sys

_root = logging.getLogger("baryon")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(os.environ.get("BARYON_LOG_LEVEL", "INFO").upper())
    _root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("baryon") else f"baryon.{name}")


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr (where a process waits:
    start-up or step hangs; `benchmarks/gpu_suite.py --stack-dump-after` sends it)."""
    if sys.__stderr__ is None:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (OSError, ValueError, io.UnsupportedOperation):  # no file descriptor behind stderr
        pass


def dump_stacks() -> None:
    """Print every thread's Python stack to stderr now."""
    if sys.__stderr__ is None:
        return
    try:
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    except (OSError, ValueError, io.UnsupportedOperation):
        pass
