"""Publishing a LoRA run's versions as adapters (`trainer.lora.publish: adapter`): the engines' own LoRA routes.

Version v's checkpoint directory is a PEFT adapter (`trainer/lora.py`). Each server loads it under a name of its
own, `lora_adapter_name(v)` (SGLang's `/load_lora_adapter`; the vLLM backend turns it into vLLM's
`/v1/load_lora_adapter`), and relabels its weight version (SGLang's `/update_weight_version`), which the rollout's
staleness checks read. Nothing is paused: no request's weights change, since a request keeps the adapter it named
for its whole life, and no request names the new one before the trainer announces it, after verification
(`publisher.py`; the proxy's engine client names the announced version's adapter, `weight_version.AnnouncedAdapter`).

Afterwards the adapters of versions before v - 1 are unloaded; v - 1 stays, since the proxy may name it until it
re-reads the announcement. An unload waits on the server for the requests still running on that adapter, so it
is started and not waited for. A version loaded again (a restarted trainer republishes the version it resumed
from) replaces the adapter of that name.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.engine.client import EngineError
from pipeline.errors import ArlError
from pipeline.trainer.publish.transports import Bucket, Outcome, ServerCalls, all_refused
from schemas.engine_api import lora_adapter_name, lora_adapter_version

log = logging.getLogger("arl.trainer.publish")


class AdapterTransport:
    """Each server loads the version's adapter directory under its version's name, then reports that version."""

    def __init__(self, calls: ServerCalls) -> None:
        self.calls = calls
        self.loaded: dict[str, dict[str, str]] = {}
        """Per server URL, the adapters it said it holds after the last load (`loaded_adapters`)."""

    def send(self, version: int, urls: list[str], checkpoint: Path | None, parts: list[Bucket]) -> Outcome:
        """Load version `version` (0: the base model, nothing to load) and relabel; `parts` are not needed."""
        failed: dict[str, str] = {}
        if version > 0:
            if checkpoint is None:
                raise ValueError("adapter publication needs the version's checkpoint directory")
            name, path = lora_adapter_name(version), str(checkpoint.resolve())
            self.calls.each(urls, "POST", "/unload_lora_adapter", {"lora_name": name})  # "not loaded": the usual case
            answers = self.calls.each(urls, "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
            failed = {
                u: f"loading adapter {name} from {path}: {r}" for u, r in answers.items() if isinstance(r, EngineError)
            }
            if all_refused(urls, failed, answers):
                raise ArlError(f"every server refused /load_lora_adapter of version {version}: {failed}")
            for url, answer in answers.items():
                if isinstance(answer, dict):
                    self.loaded[url] = dict(answer.get("loaded_adapters") or {})
        live = [u for u in urls if u not in failed]
        relabel = {"new_version": str(version), "abort_all_requests": False}
        failed.update(self.calls.failures(live, "POST", "/update_weight_version", relabel))
        return Outcome([u for u in urls if u not in failed], failed)

    def retire(self, version: int, urls: list[str]) -> None:
        """Start unloading, on `urls`, the adapters of versions before `version - 1` (not waited for)."""
        for url in urls:
            old = [n for n in self.loaded.get(url, {}) if (lora_adapter_version(n) or version) < version - 1]
            for name in old:
                self.calls.start([url], "POST", "/unload_lora_adapter", {"lora_name": name})
                self.loaded[url].pop(name, None)
            if old:
                log.info("%s: unloading adapters %s (version %d is served)", url, old, version)

    def close(self) -> None:
        """Nothing to release: the servers keep the adapters they serve."""
