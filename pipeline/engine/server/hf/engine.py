"""The `hf` backend: a transformers model and its scheduler thread, behind the engine app (`app.py`).

The model lives in the scheduler thread (`batcher.py`); the backend methods only enqueue work and
await its events, so a long forward pass never stalls the event loop. Weight updates are in
`updates.py`; serving it (a process, or in this one) in `process.py`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pipeline.engine.server.backend import Check, Progress, model_info_body
from pipeline.engine.server.hf.batcher import Scheduler
from pipeline.engine.server.hf.lora_adapters import LoraAdapters
from pipeline.engine.server.hf.prefix_cache import PrefixCache, describe
from pipeline.engine.server.hf.sampling import RowSampling
from pipeline.engine.server.hf.sequences import GenRequest
from pipeline.engine.server.hf.updates import StagedUpdate, WeightUpdates
from pipeline.engine.server.requests import Limits, RequestError, WorkItem, stop_token_ids
from pipeline.engine.server.weights import eos_token_ids, load_model, load_tokenizer, resolve_device
from schemas.engine_api import (
    LoadLoRAAdapterReqInput,
    SamplingParams,
    UnloadLoRAAdapterReqInput,
    UpdateWeightVersionReqInput,
)

_HEALTH_GENERATE_TIMEOUT_S = 20.0
_DRAIN_TIMEOUT_S = 3600.0  # a pause with mode `wait` outlasts the longest completion; the caller has its own deadline


@dataclass
class HFEngineConfig:
    model_path: str
    tokenizer_path: str | None = None
    device: str = "auto"
    dtype: str = "float32"
    max_batch_size: int = 64
    max_context: int | None = None
    """Prompt + completion limit; None = the model's `max_position_embeddings`."""
    weight_version: int = 0
    return_original_logprob: bool = False
    """Unscaled logprobs even when temperature != 1 (SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB)."""
    incremental_streaming_output: bool = False
    """Stream deltas instead of SGLang's default cumulative `output_ids` / `text` (its flag of the same name)."""
    seed: int | None = None
    weight_group_timeout_s: float = 600.0
    prefix_cache_mb: int = 256
    """Memory for the KV cache of finished requests, reused by later requests sharing their prefix; 0: off."""


class HFEngine(WeightUpdates):
    """The model and its scheduler, as an `EngineBackend`; `start()` before serving, `stop()` after."""

    failure_status = 500
    serves_input_logprobs = True

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self.model_path = config.model_path
        self.device = resolve_device(config.device)
        self.model = load_model(config.model_path, device=self.device, dtype=config.dtype)
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        model_max = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.limits = Limits(int(self.model.config.vocab_size), min(config.max_context or model_max, model_max))
        original = config.return_original_logprob or _env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB")
        self.prefix_cache = PrefixCache(config.prefix_cache_mb * 2**20) if config.prefix_cache_mb > 0 else None
        self.lora = LoraAdapters(self.model)
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            max_batch_size=config.max_batch_size,
            max_context=self.limits.max_context,
            eos_ids=self.eos_ids,
            weight_version=config.weight_version,
            return_original_logprob=original,
            seed=config.seed,
            prefix_cache=self.prefix_cache,
            lora=self.lora,
        )
        self.weight_groups: dict[str, Any] = {}
        self.staged = StagedUpdate()
        self.incremental_stream = config.incremental_streaming_output
        self.requests_total = 0
        self.started_at = time.time()

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    # -- generation -------------------------------------------------------------------------
    async def generate(self, item: WorkItem, *, stream: bool) -> AsyncGenerator[Progress, None]:
        """The scheduler's events for `item` (not streamed: only the last, holding everything); aborts it if closed
        early."""
        params = item.params
        if item.routed_experts_start >= 0 and not self.scheduler.routers:
            raise RequestError(
                "return_routed_experts needs a mixture-of-experts model; the served model has no expert routers"
            )
        queue: asyncio.Queue[Progress] = asyncio.Queue()
        top_k = item.top_logprobs_num if item.return_logprob else 0  # zero: no top-k work for this row
        sampling = RowSampling(
            params.temperature, params.top_p, params.top_k, params.min_p, self._seeded(params), top_k
        )
        request = GenRequest(
            rid=item.rid,
            input_ids=item.input_ids,
            max_new_tokens=item.max_new_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids(params, self.eos_ids),
            stop_strings=params.stop_strings(),
            loop=asyncio.get_running_loop(),
            events=queue,
            logprob_start_len=item.logprob_start_len if item.return_logprob else -1,
            lora=self.lora.get(item.lora) if item.lora is not None else None,
            routed_experts_start=item.routed_experts_start,
            stream=stream,
        )
        self.scheduler.submit(request)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish is not None
                yield event
        finally:
            if not finished:
                self.scheduler.call(lambda: self.scheduler.abort(item.rid, "client went away"))

    def _seeded(self, params: SamplingParams) -> Any:
        """A generator for the request's own `sampling_seed` (reproducible sampling), else None."""
        if params.sampling_seed is None:
            return None
        import torch

        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(params.sampling_seed))
        return generator

    async def health(self, *, generate: bool) -> Check:
        if not self.scheduler.alive:
            return Check(False, f"engine scheduler is not running: {self.scheduler.error}")
        if not generate or self.scheduler.paused is not None:
            return Check(True)  # paused on purpose: a generation would wait for /continue_generation
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        item = WorkItem(f"health-{time.monotonic_ns()}", [self.scheduler.pad_id], params, 1, False)
        try:
            await asyncio.wait_for(_drain(self.generate(item, stream=False)), timeout=_HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return Check(False, f"a 1-token generation did not finish within {_HEALTH_GENERATE_TIMEOUT_S:.0f} s")
        return Check(True)

    # -- control ----------------------------------------------------------------------------
    async def abort(self, rid: str | None, message: str) -> None:
        await self._on_scheduler(lambda: self.scheduler.abort(rid, message))

    async def pause(self, mode: str) -> str:
        await self._on_scheduler(lambda: self.scheduler.pause(mode))
        if mode == "wait":  # answer once the requests in flight have finished (new ones wait)
            deadline = time.monotonic() + _DRAIN_TIMEOUT_S
            while not await self._on_scheduler(self.scheduler.drained):
                if time.monotonic() > deadline:
                    raise RequestError(
                        f"paused (mode wait), but requests still run after {_DRAIN_TIMEOUT_S:.0f}s; "
                        "/continue_generation, or pause with mode retract"
                    )
                await asyncio.sleep(0.02)
        return f"generation paused (mode {mode})"

    async def resume(self) -> None:
        await self._on_scheduler(self.scheduler.resume)

    async def flush_cache(self) -> Check:
        if self.prefix_cache is None:
            return Check(True, "Cache flushed (the prefix cache is off: --prefix-cache-mb 0).\n")
        entries, nbytes = await self._on_scheduler(self.prefix_cache.clear)
        return Check(True, f"Cache flushed: dropped {entries} prefix-cache entries ({nbytes} bytes).\n")

    async def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # -- LoRA adapters (SGLang's routes; `lora_adapters.py`) ------------------------------------------
    def loaded_adapters(self) -> dict[str, str]:
        return self.lora.loaded()

    async def load_lora_adapter(self, body: LoadLoRAAdapterReqInput) -> dict[str, str]:
        """Load and check the adapter (off the event loop), then serve it from the next step on."""
        if body.lora_name in self.lora.adapters:
            raise RequestError(f"a LoRA adapter named {body.lora_name!r} is already loaded; unload it first")
        adapter = await asyncio.to_thread(self.lora.read, body.lora_name, body.lora_path)
        await self._on_scheduler(lambda: self.lora.register(adapter))
        return self.lora.loaded()

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterReqInput) -> dict[str, str]:
        """Refuse new requests for the adapter, wait for those it serves, then drop it."""
        adapter = self.lora.get(body.lora_name)
        adapter.retiring = True
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while await self._on_scheduler(lambda: self.scheduler.serving(adapter)):
            if time.monotonic() > deadline:
                adapter.retiring = False
                raise RequestError(f"adapter {body.lora_name!r} still serves requests after {_DRAIN_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.02)
        await self._on_scheduler(lambda: self.lora.unregister(body.lora_name))
        return self.lora.loaded()

    async def update_weight_version(self, body: UpdateWeightVersionReqInput, version: int) -> str:
        """SGLang's relabelling: the served weights are untouched, new tokens report `version`."""
        if body.abort_all_requests:
            await self.abort(None, "aborted by /update_weight_version")

        def relabel() -> None:
            self.scheduler.weight_version = version

        await self._on_scheduler(relabel)
        return f"weight version updated to {version}"

    # -- info -------------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        tokenizer = self.config.tokenizer_path or self.config.model_path  # what was loaded, whatever the weights
        return {
            **model_info_body(self.model_path, tokenizer, self.weight_version, self.limits),
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "backend": "hf",
            "model_path": self.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "device": str(self.device),
            "dtype": self.config.dtype,
            "max_batch_size": self.config.max_batch_size,
            "context_length": self.limits.max_context,
            "weight_version": str(self.weight_version),
            "paused": self.scheduler.paused,
            "return_original_logprob": self.scheduler.return_original_logprob,
            "incremental_streaming_output": self.config.incremental_streaming_output,
            "started_at": self.started_at,
            "num_requests": self.requests_total,
            "prefix_cache": describe(self.prefix_cache),
            "lora_adapters": self.lora.loaded(),
            **self.scheduler.load(),
        }


async def _drain(events: AsyncIterator[Progress]) -> None:
    async for _ in events:
        pass


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
