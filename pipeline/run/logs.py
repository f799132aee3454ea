"""Process set-up shared by every stage: one logging configuration (human-readable lines to stderr and,
for stages run by hand, a log file) and the event loop async stages run on."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


def setup_logging(stage: str | None = None, log_file: Path | None = None, level: str | None = None) -> None:
    """Configure the root logger once per process (idempotent: re-running replaces the handlers)."""
    level_name = (level or os.environ.get("ARL_LOG_LEVEL", "INFO")).upper()
    root = logging.getLogger()
    root.setLevel(level_name)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(_FORMAT)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(formatter)
    root.addHandler(stream)
    # Under `arl launch` (ARL_ATTEMPT set) the launcher already sends this process's stdout/stderr
    # to the attempt log; a file handler on the same file would write every line twice.
    if log_file is not None and not os.environ.get("ARL_ATTEMPT"):
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    # Third-party request logs would print every proxied call (and could carry headers).
    for noisy in ("httpx", "httpcore", "uvicorn.access", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if stage:
        logging.getLogger("arl").info("stage %s starting (pid %d)", stage, os.getpid())


def freeze_for_exit() -> None:
    """Hide every live object from the cyclic GC before the interpreter exits (`gc.freeze`).

    A process that imported torch and transformers spent ~0.7 s of its exit in the collections the
    interpreter runs while it tears modules down (measured: 0.71 s -> 0.13 s after a preflight). Stages
    exit one after another at the end of a run (the trainer, then the stages it stops, then the
    launcher), so that was seconds of every run's wall time. Nothing is lost: objects are still freed
    by reference counting and `atexit` handlers still run; only cyclic garbage is left to the OS.
    """
    import gc

    gc.freeze()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop when it is installed (`uvicorn[standard]` brings it): the proxy's
    per-request cost is dominated by event-loop and HTTP parsing overhead, which uvloop roughly halves."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
