"""The package logger: `baryon` messages go to stderr at INFO unless BARYON_LOG_LEVEL says otherwise."""

import logging
import os

_root = logging.getLogger("baryon")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(os.environ.get("BARYON_LOG_LEVEL", "INFO").upper())
    _root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("baryon") else f"baryon.{name}")
