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

from pipeline.handoff import write_json_atomic
from pipeline.paths import TMP_SUFFIX, RunPaths
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


def urls_from_registry(paths: RunPaths, *, routable_only: bool = True) -> Callable[[], list[str]]:
    """A callable for `EngineClient(urls=...)`: the URLs registered right now (re-read on each call).

    Requests go only to routable servers; the trainer's publisher (`routable_only=False`) also reaches
    the ones waiting to be brought up to the announced version.
    """

    def urls() -> list[str]:
        return [entry.url for entry in read_entries(paths).values() if entry.routable or not routable_only]

    return urls
