"""`registry/inference/<server>.json`: how the proxy and the trainer find the inference servers.

`stages.inference` writes one entry per server atomically when it is healthy and removes it when
the server stops or dies. An entry marked not `routable` is a restarted server still behind the
announced weight version: the trainer updates it, nothing routes requests to it. Readers (the engine
client, `arl status`) list the directory. A reader never sees a torn entry (atomic replace) and skips
an unreadable one with a warning rather than failing a whole rollout because of one stray file.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import TMP_SUFFIX, RunPaths
from schemas.engine_api import InferenceEntry

log = logging.getLogger("arl.engine.registry")


def write_entry(paths: RunPaths, server: str, entry: InferenceEntry) -> Path:
    """Publish (or replace) the entry of `server` atomically."""
    return write_json_atomic(paths.inference_entry(server), entry.model_dump(mode="json"))


def remove_entry(paths: RunPaths, server: str) -> None:
    """Deregister `server` (no error if it is already gone)."""
    with contextlib.suppress(FileNotFoundError):
        paths.inference_entry(server).unlink()


def read_entries(paths: RunPaths) -> dict[str, InferenceEntry]:
    """Every readable entry, by server name, sorted by name (a stable routing order)."""
    entries: dict[str, InferenceEntry] = {}
    try:
        files = sorted(paths.inference_registry.glob("*.json"))
    except FileNotFoundError:
        return entries
    for path in files:
        if path.name.endswith(TMP_SUFFIX):
            continue
        try:
            entries[path.stem] = InferenceEntry.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            continue  # removed between listing and reading
        except (json.JSONDecodeError, ValidationError) as exc:
            log.warning("skipping unreadable registry entry %s: %s", path, exc)
    return entries


def retire_entry(paths: RunPaths, name: str, entry: InferenceEntry, why: str) -> None:
    """Remove the entry of a server nothing supervises any more, leaving a note in `state/retired/`.

    The note tells a trainer waiting for that server to come back after a failed swap that it never will
    (`retired_since`). Used by a relaunched inference stage for the servers of an attempt that ended.
    """
    write_json_atomic(
        paths.retired_entry(name),
        {"server": name, "url": entry.url, "started_at": entry.started_at, "attempt": entry.attempt, "why": why},
    )
    remove_entry(paths, name)
    log.warning("retired registry entry %s (%s): %s", name, entry.url, why)


def retired_since(paths: RunPaths, started_at: dict[str, float]) -> set[str]:
    """Of the servers `started_at` names (name -> start time), those retired in that life (`retire_entry`)."""
    out = set()
    for name, started in started_at.items():
        try:
            note = json.loads(paths.retired_entry(name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if note.get("started_at") == started:
            out.add(name)
    return out


def urls_from_registry(paths: RunPaths, *, routable_only: bool = True) -> Callable[[], list[str]]:
    """A callable for `EngineClient(urls=...)`: the URLs registered right now (re-read on each call).

    Requests go only to routable servers; the trainer's publisher (`routable_only=False`) also reaches
    the ones waiting to be brought up to the announced version.
    """

    def urls() -> list[str]:
        return [entry.url for entry in read_entries(paths).values() if entry.routable or not routable_only]

    return urls
