"""Atomic publication of files and directories, and waits with deadlines.

The run dir is the only channel between jobs, so a reader must never see a half-written file:
every file is written to a temp name, fsynced and `os.replace`d; a directory is built under a
temp name with its marker written last, then renamed into place. Readers trust a directory only
when its marker exists and ignore `*.tmp*` names.

Every wait has a deadline, and its error names what was awaited, who should have produced it
and where that producer's log is, so a stuck run explains itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import ArlError, WaitTimeout

T = TypeVar("T")

_HINT = " (is the disk full, over quota, or the run dir read-only? nothing was published)"
# Libraries that write for us (torch, safetensors, pyarrow) report a full disk or a read-only
# run dir as RuntimeError/their own error types, with the cause in the text and no file name.
_IO_CAUSES = (
    "No space left",
    "File too large",
    "Permission denied",
    "Read-only file system",
    "Disk quota exceeded",
    "os error",
    "write():",
    "I/O error",
)


class PublishError(ArlError):
    """Writing a file or directory another job reads failed (full disk, quota, read-only run dir)."""


@contextlib.contextmanager
def naming_write_errors(target: str | Path) -> Iterator[None]:
    """Re-raise a failed write as a PublishError that names `target` and the cause (the original is chained)."""
    try:
        yield
    except OSError as exc:
        cause = exc.strerror or str(exc)
        raise PublishError(f"could not write {target}: {cause}{_HINT}") from exc
    except Exception as exc:
        if not any(marker in str(exc) for marker in _IO_CAUSES):
            raise
        raise PublishError(f"could not write {target}: {exc}{_HINT}") from exc


def fsync_dir(path: Path) -> None:
    """Persist a rename: without syncing the parent, a crash can forget the new name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` so readers see the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with naming_write_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def staging_dir(final: str | Path) -> Iterator[Path]:
    """A fresh temp dir beside `final`, removed if the block fails (publish it with `publish_dir`)."""
    final = Path(final)
    tmp = final.with_name(f"{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    with naming_write_errors(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def publish_dir(staged: Path, final: str | Path, marker: str, marker_content: Any) -> Path:
    """Write `marker` into `staged` last, then move it to `final`, replacing any old version whole.

    Between the two renames `final` briefly does not exist: readers then see "not published",
    which is true, rather than a mixture of old and new files.
    """
    final = Path(final)
    with naming_write_errors(final):
        for child in staged.rglob("*"):  # a subdirectory (a LoRA checkpoint's merged/) is published with it
            if child.is_file():
                _fsync_file(child)
        write_json_atomic(staged / marker, marker_content)
        old: Path | None = None
        if final.exists():
            old = final.with_name(f"{final.name}.{uuid.uuid4().hex[:8]}.old.tmp")
            os.replace(final, old)
        os.replace(staged, final)
        fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_published(final: str | Path) -> None:
    """Unpublish a directory: rename it away first so no reader sees it without some files."""
    final = Path(final)
    if not final.exists():
        return
    doomed = final.with_name(f"{final.name}.{uuid.uuid4().hex[:8]}.old.tmp")
    os.replace(final, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_stale_tmp(parent: str | Path) -> list[Path]:
    """Delete leftovers of writers killed mid-publish (`*.tmp` files and dirs) under `parent`."""
    removed: list[Path] = []
    parent = Path(parent)
    if not parent.exists():
        return removed
    for child in parent.iterdir():
        if child.name.endswith(".tmp"):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    child.unlink()
            removed.append(child)
    return removed


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


POLL_FIRST_S = 0.005
POLL_BACKOFF = 0.05
"""A wait polls every 5 ms at first, then every 5% of the time it has waited so far, up to its `poll_s`: a
handoff that comes quickly (a pipelined step, ~0.1-1 s) is seen within a few ms, a long wait costs few
`stat` calls (the run dir may be on a shared filesystem, where another node's write is seen only by polling)."""


def poll_delay(waited_s: float, poll_s: float) -> float:
    """Seconds to sleep before the next check of a wait that began `waited_s` ago (see POLL_BACKOFF)."""
    return min(poll_s, max(POLL_FIRST_S, waited_s * POLL_BACKOFF))


def wait_for(
    check: Path | Callable[[], T | None],
    *,
    what: str,
    upstream: str,
    log: Path | None,
    timeout_s: float,
    poll_s: float = 0.5,
    on_poll: Callable[[float], None] | None = None,
) -> T | Path:
    """Wait until `check` (a path that must exist, or a callable returning non-None) is satisfied.

    On timeout raise `WaitTimeout` naming what was awaited, the upstream stage and its log.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        if isinstance(check, Path):
            if check.exists():
                return check
        else:
            result = check()
            if result is not None:
                return result
        now = time.monotonic()
        if now >= deadline:
            where = f"; see its log: {log}" if log is not None else ""
            raise WaitTimeout(
                f"timed out after {timeout_s:.0f}s waiting for {what} "
                f"(produced by the {upstream} stage{where}). Is the {upstream} stage running? "
                f"Check `arl status` for the run."
            )
        if on_poll is not None:
            on_poll(deadline - now)
        time.sleep(min(poll_delay(now - started, poll_s), max(deadline - now, 0.0)))
