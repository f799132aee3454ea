"""The `vllm` backend's LoRA adapters (`trainer.lora.publish: adapter`): SGLang's LoRA routes over vLLM's.

* `/load_lora_adapter` {lora_name, lora_path}: vLLM's `/v1/load_lora_adapter` with the same two fields. vLLM
  serves it only when started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, which
  `procs.py` sets when the run publishes adapters. A name already loaded is refused (as SGLang, one adapter
  per name: a new version is loaded under a new name, `schemas.engine_api.lora_adapter_name`).
* `/unload_lora_adapter` {lora_name}: as SGLang, the name is refused to new requests at once, and the unload
  waits for the requests running on the adapter to finish (at most `drain_timeout_s`; past it the adapter is
  served again and the unload fails), then vLLM's `/v1/unload_lora_adapter` drops it.
* a `/generate` request naming a loaded adapter (`lora_path`, per prompt) goes to vLLM as `model: <name>`
  (vLLM's way of choosing a LoRA adapter); a name that is not loaded is refused (400) before reaching vLLM.

A load or unload returns the adapters loaded after it (the app answers SGLang's `LoRAUpdateOutput` with them).
Any failure is a `RequestError` carrying vLLM's status and message (the app's 400 with `success: false`), as
SGLang answers every failed load or unload; that includes vLLM's 500 for an adapter its worker cannot take
(e.g. "LoRA rank 16 is greater than max_lora_rank 8"), after which vLLM serves on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx

from pipeline.engine.server.requests import RequestError
from schemas.engine_api import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

NOT_ENABLED = (
    "LoRA is not enabled on this vLLM server: vLLM serves /v1/load_lora_adapter only when started with "
    "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (arl starts it so with trainer.lora.publish=adapter)"
)


class LoraAdapters:
    """The adapters loaded in vLLM, by name, and the requests running on each."""

    def __init__(self, http: httpx.AsyncClient, drain_timeout_s: float) -> None:
        self.http = http
        self.drain_timeout_s = drain_timeout_s
        self.loaded: dict[str, str] = {}
        """Name -> adapter directory, of the adapters new requests may name."""
        self.running: Counter[str] = Counter()
        """Requests in flight per adapter name."""
        self.lock = asyncio.Lock()  # one load or unload at a time (SGLang's lora_update_lock)

    # -- requests ---------------------------------------------------------------------------
    def check(self, name: str | None) -> None:
        """Refuse a request naming an adapter that is not loaded (None: the base model, always served)."""
        if name is not None and name not in self.loaded:
            loaded = ", ".join(sorted(self.loaded)) or "none"
            raise RequestError(
                f"lora_path {name!r} names no loaded LoRA adapter (loaded: {loaded}); load it with /load_lora_adapter"
            )

    def acquire(self, name: str | None) -> None:
        """A request on adapter `name` starts (an unload waits for it); refused if the name is not loaded."""
        self.check(name)
        if name is not None:
            self.running[name] += 1

    def release(self, name: str | None) -> None:
        if name is not None:
            self.running[name] -= 1
            if self.running[name] <= 0:
                del self.running[name]

    # -- routes -----------------------------------------------------------------------------
    async def load(self, body: LoadLoRAAdapterReqInput) -> dict[str, str]:
        """Load an adapter in vLLM under a new name; returns the adapters loaded now."""
        async with self.lock:
            if body.lora_name in self.loaded:
                raise RequestError(
                    f"a LoRA adapter named {body.lora_name!r} is already loaded (from {self.loaded[body.lora_name]}); "
                    "unload it first, or load the new weights under a new name"
                )
            resp = await self.http.post(
                "/v1/load_lora_adapter", json={"lora_name": body.lora_name, "lora_path": body.lora_path}
            )
            _check(resp, "load", body.lora_name, f" from {body.lora_path}")
            self.loaded[body.lora_name] = body.lora_path
            return dict(self.loaded)

    async def unload(self, body: UnloadLoRAAdapterReqInput) -> dict[str, str]:
        """Refuse new requests the adapter at once, wait for those running on it, then have vLLM drop it; returns
        the adapters loaded now. If that fails, the adapter is served again."""
        async with self.lock:
            path = self.loaded.pop(body.lora_name, None)
            if path is None:
                loaded = ", ".join(sorted(self.loaded)) or "none"
                raise RequestError(f"LoRA adapter {body.lora_name!r} is not loaded (loaded: {loaded})")
            try:
                await self._drain(body.lora_name)
                resp = await self.http.post("/v1/unload_lora_adapter", json={"lora_name": body.lora_name})
                _check(resp, "unload", body.lora_name)
            except BaseException:
                self.loaded[body.lora_name] = path
                raise
            return dict(self.loaded)

    async def _drain(self, name: str) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.running[name] > 0:
            if time.monotonic() > deadline:
                raise RequestError(
                    f"unload of LoRA adapter {name!r}: {self.running[name]} requests still run on it after "
                    f"{self.drain_timeout_s:g} s; it is served again (abort them, or retry later)"
                )
            await asyncio.sleep(0.01)


def _check(resp: httpx.Response, what: str, name: str, where: str = "") -> None:
    """A `RequestError` with vLLM's status and message unless vLLM did it."""
    if resp.status_code < 400:
        return
    try:
        detail: Any = resp.json()
    except ValueError:
        detail = resp.text[:2000]
    if resp.status_code == 404 and detail == {"detail": "Not Found"}:  # FastAPI's: vLLM has no such route
        raise RequestError(NOT_ENABLED)
    message = detail.get("error", {}).get("message") if isinstance(detail, dict) else None
    verb = "failed" if resp.status_code >= 500 else "refused"
    raise RequestError(f"vLLM {verb} to {what} LoRA adapter {name!r}{where} ({resp.status_code}): {message or detail}")
