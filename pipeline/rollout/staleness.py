"""Staleness control: rollout of step k may use weights of version >= max(k - max_staleness, 0) (docs/rollout.md).

The bound itself is `pipeline.run.weight_version.oldest_usable_version`, shared with the trainer's filter and
the external admission so that the three cannot drift apart.

Enforced twice. Before a step's sessions are admitted, the rollout waits until both the trainer's
published version (`state/weight_version.json`; version 0 needs no file) and every engine server's
reported version reach the bound. After the runs, each sample's per-token `versions` are checked:
a sample whose oldest sampled token is older than the bound (a server that had not reloaded, or a
session that straddled an update) is dropped and counted, never trained on silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from pipeline.engine.client import EngineError
from pipeline.errors import WaitTimeout
from pipeline.run.handoff import poll_delay
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import oldest_usable_version, published_version
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.rollout")


async def wait_for_version(
    paths: RunPaths,
    needed: int,
    *,
    timeout_s: float,
    engine_version: Callable[[], Awaitable[int]] | None = None,
    poll_s: float = 0.5,
    what: str = "rollout",
) -> int:
    """Wait until the published version (and the engines' reported one) is >= `needed`; return it.

    No server answering (none registered, or all restarting: an inference stage that is being replaced,
    servers taken out by a failed weight swap) is waited out like an old version, within the same deadline.
    On timeout raise `WaitTimeout` naming state/weight_version.json, the trainer stage and its log, and
    the servers' last error.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last_note = 0.0
    file_version = engine = -1
    unreachable = ""
    while True:
        file_version = published_version(paths)
        if file_version >= needed:
            try:
                engine = await engine_version() if engine_version is not None else file_version
                unreachable = ""
            except EngineError as exc:
                engine, unreachable = -1, str(exc)
            if engine >= needed:
                return min(file_version, engine)
        now = time.monotonic()
        if now >= deadline:
            break
        if now - last_note > 30:
            log.info(
                "%s waits for weight version >= %d (published: %d)%s",
                what,
                needed,
                file_version,
                f"; the servers: {unreachable}" if unreachable else "",
            )
            last_note = now
        await asyncio.sleep(min(poll_delay(now - started, poll_s), max(deadline - now, 0.0)))
    engines = f"; the engine servers report version {engine}" if engine >= 0 else ""
    engines += f"; the engine servers did not answer: {unreachable}" if unreachable else ""
    raise WaitTimeout(
        f"timed out after {timeout_s:.0f}s waiting for weight version >= {needed} in {paths.weight_version} "
        f"(published: {file_version}{engines}), produced by the train stage; see its log: "
        f"{paths.latest_log('train')}. Is the trainer running? Raise rollout.wait_timeout_s or "
        "rollout.max_staleness if it is just slow"
    )


def oldest_version(row: TrajectoryRow) -> int:
    """The oldest weight version among a sample's sampled tokens."""
    sampled = [v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
    return min(sampled) if sampled else -1


def split_stale(rows: list[TrajectoryRow], step: int, max_staleness: int) -> tuple[list[TrajectoryRow], int]:
    """(rows within the bound, number dropped for an older token)."""
    bound = oldest_usable_version(step, max_staleness)
    kept = [r for r in rows if oldest_version(r) >= bound]
    return kept, len(rows) - len(kept)


def staleness_histogram(rows: list[TrajectoryRow], step: int) -> dict[str, int]:
    """Samples by staleness = step - oldest sampled version (string keys: it goes to JSON)."""
    counts = Counter(step - oldest_version(r) for r in rows)
    return {str(k): counts[k] for k in sorted(counts)}
