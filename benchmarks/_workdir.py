"""The learning benchmarks' work directory: kept where `--workdir` names it, else a temp dir removed at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def work_dir(kept: str | None, prefix: str) -> Iterator[Path]:
    """`kept` (the script's --workdir) as an absolute path, left in place afterwards so its runs can be read again;
    without it a fresh temp dir, removed however the benchmark ends (its runs hold models and shards: megabytes each
    that nobody asked to keep)."""
    path = Path(kept or tempfile.mkdtemp(prefix=prefix)).resolve()
    try:
        yield path
    finally:
        if not kept:
            shutil.rmtree(path, ignore_errors=True)
