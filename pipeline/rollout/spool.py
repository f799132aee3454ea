"""The standalone proxy stage's spool: finished outside sessions kept on disk until their step is published.

An outside agent moves on once its `/rl/end_session` (or `/rl/v1/finalize`) call succeeds, so a
finished session held only in the stage's memory would be lost for good by a `kill -9`. The stage
therefore subscribes to the proxy's session ends, exports each finished session and writes it to
`state/proxy_spool/<session_id>.json` *before* the end call answers: a 2xx means the session is on
disk (docs/rollout.md, "External agents").

* **write** — one JSON file per session, published atomically (temp + fsync + rename + dir fsync):
  the exported rows in their wire form (`TrajectoryRow.to_wire`: every shard column but `step`), the
  run status, its counts and its finish time. JSON round-trips exactly: token ids are ints, and
  Python writes floats with `repr` (the shortest string that reads back to the same double), so
  every logprob (a float32 value, widened) comes back with the same bits.
* **load** (stage start) — leftover `*.tmp` files of a write cut by a kill are removed; a file that
  does not parse as a spooled session is renamed `<name>.corrupt` and reported (path and reason) at
  ERROR level: kept for a person, never trained on, never a crash. Sessions already in a published
  step (its manifest's `extra.consumed_sessions` lists every session the step consumed) are
  removed: the stage died between publishing the step and cleaning up, and counting them again
  would duplicate their samples. The rest count toward the next step, in finish order.
* **remove** — after a step's manifest is published, the files of the sessions it consumed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from pipeline.run.handoff import clean_stale_tmp, fsync_dir, write_bytes_atomic
from pipeline.run.paths import RunPaths
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.proxy.spool")

SPOOL_FORMAT = 1
CONSUMED_KEY = "consumed_sessions"
"""The manifest `extra` key listing every session a step consumed (with or without samples)."""
STATUSES = ("ok", "failed", "rejected", "abandoned", "unexported")
CORRUPT_SUFFIX = ".corrupt"
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class SpoolError(ArlError):
    """A spool file that cannot be a spooled session (torn by a foreign writer, edited, another format)."""


@dataclass(frozen=True)
class SpooledSession:
    """One finished outside session as the step export needs it."""

    session_id: str
    status: str
    """"ok", "failed", "rejected", "abandoned" (idle past the timeout) or "unexported" (the proxy refused)."""
    finished_at: float
    """Wall-clock seconds when the stage recorded it: the order sessions fill steps in, across restarts."""
    num_interactions: int = 0
    prefix_breaks: int = 0
    samples: tuple[TrajectoryRow, ...] = ()
    """The exported rows (no step assigned yet)."""

    def to_json(self) -> bytes:
        record = {
            "format": SPOOL_FORMAT,
            "session_id": self.session_id,
            "status": self.status,
            "finished_at": self.finished_at,
            "num_interactions": self.num_interactions,
            "prefix_breaks": self.prefix_breaks,
            "samples": [row.to_wire() for row in self.samples],
        }
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> SpooledSession:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpoolError(f"{where}: not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != SPOOL_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise SpoolError(f"{where}: not a spooled session of format {SPOOL_FORMAT} (format {found!r})")
        samples = data.get("samples")
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise SpoolError(f"{where}: samples must be a list of row objects")
        try:
            record = cls(
                session_id=_session_id(data["session_id"]),
                status=str(data["status"]),
                finished_at=float(data["finished_at"]),
                num_interactions=int(data["num_interactions"]),
                prefix_breaks=int(data["prefix_breaks"]),
                samples=tuple(TrajectoryRow.from_wire(s) for s in samples),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SpoolError(f"{where}: missing or malformed field ({type(exc).__name__}: {exc})") from None
        if record.status not in STATUSES:
            raise SpoolError(f"{where}: status {record.status!r} is not one of {list(STATUSES)}")
        return record


def _session_id(value: Any) -> str:
    """Session ids become file names: only the proxy's own id alphabet is accepted."""
    if not isinstance(value, str) or not _SESSION_ID_RE.match(value):
        raise ValueError(f"session id {value!r} must match {_SESSION_ID_RE.pattern}")
    return value


class Spool:
    """`state/proxy_spool/`: write a finished session, load what a previous run left, remove published ones."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self.dir = paths.proxy_spool

    def write(self, record: SpooledSession) -> Path:
        """Durable when this returns (blocking: call it from a thread inside the event loop)."""
        return write_bytes_atomic(self.paths.proxy_spool_entry(_session_id(record.session_id)), record.to_json())

    def load(self) -> list[SpooledSession]:
        """The spooled sessions no published step holds, in finish order (see the module docstring)."""
        for leftover in clean_stale_tmp(self.dir):
            log.warning("removed %s: a spool write cut short by a kill (its end call never succeeded)", leftover)
        records = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                record = SpooledSession.from_json(path.read_bytes(), str(path))
                if path.name != self.paths.proxy_spool_entry(record.session_id).name:
                    raise SpoolError(f"{path}: holds session {record.session_id!r}, not the one its name says")
            except SpoolError as exc:
                quarantined = path.with_name(path.name + CORRUPT_SUFFIX)
                os.replace(path, quarantined)
                log.error("spool file ignored and kept as %s for inspection: %s", quarantined, exc)
                continue
            records.append(record)
        if not records:
            return []
        published = published_sessions(self.paths)
        done = [r.session_id for r in records if r.session_id in published]
        if done:
            log.info(
                "%d spooled sessions are already in a published step (the stage stopped before removing "
                "them): removed, not counted again",
                len(done),
            )
            self.remove(done)
        kept = [r for r in records if r.session_id not in published]
        return sorted(kept, key=lambda r: (r.finished_at, r.session_id))

    def remove(self, session_ids: Iterable[str]) -> None:
        """Delete the files of published sessions (missing ones are fine: a re-run after a crash)."""
        removed = False
        for session_id in session_ids:
            with contextlib.suppress(FileNotFoundError):
                self.paths.proxy_spool_entry(session_id).unlink()
                removed = True
        if removed:
            fsync_dir(self.dir)

    def pending(self) -> int:
        """Spooled sessions on disk right now."""
        return len(list(self.dir.glob("*.json"))) if self.dir.is_dir() else 0


def published_sessions(paths: RunPaths) -> set[str]:
    """Every session id a published step lists as consumed."""
    from pipeline.run.shards import read_manifest

    found: set[str] = set()
    for step in paths.complete_steps():
        consumed = read_manifest(paths, step).extra.get(CONSUMED_KEY, [])
        found.update(str(s) for s in consumed)
    return found
