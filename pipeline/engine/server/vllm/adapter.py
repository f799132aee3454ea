"""The `vllm` backend: SGLang's protocol (the engine app, `app.py`) in front of a vLLM OpenAI server.

The engine client, proxy and trainer keep speaking SGLang's protocol; this backend turns each
completion into a token-in/token-out `/v1/completions` call (see `wire.py`) and the admin
commands into vLLM calls:

* weight updates and the broadcast group: `/collective_rpc` into `worker_ext.ArlWorkerExtension`
  (vLLM runs with VLLM_SERVER_DEV_MODE=1). Like SGLang, a disk update waits for the requests in flight
  to finish (new ones wait), or aborts them with `abort_all_requests`; then the prefix cache is
  reset and `weight_version` bumped. A broadcast session (`/begin_weight_update` ... `/end_weight_update`)
  waits for them at its begin and holds new requests until its end: the workers' layers are being
  replaced in between (vLLM's layerwise reload), and the prefix cache is reset at the end. Requests
  frozen by a `retract` / `in_place` pause are not waited for: the weights are swapped under them;
* pause (`gate.py`): `abort` aborts the requests in flight, `wait` lets them finish, `retract` and
  `in_place` freeze them inside vLLM (`/pause?mode=keep`, `clear_cache` true or false) until
  `/continue_generation` (`/resume`); new requests are held in every mode. The trainer's verification
  probe (`rid` prefix `VERIFY_RID_PREFIX`, prompt scoring, nothing generated) runs while paused, as on the
  hf engine, but never during a weight update nor while vLLM holds requests frozen (it schedules nothing
  then: `/server_info` says `scores_while_paused: false`);
* completions are streamed from vLLM whether the caller streams or not, so each token is labelled with
  the weight version current when it arrived (`Progress.new_versions`; what is exact: `gate.py`).
  Every request carries vLLM's `cache_salt` `arl-v<version>`, so the prefix cache never hands one
  version's KV to a request of another (vLLM cannot reset the cache while frozen requests hold blocks);
* abort cancels the upstream HTTP call, which makes vLLM abort the request;
* input logprobs (`logprob_start_len` >= 0) are vLLM's prompt logprobs (see `wire.py`); vLLM
  does not stream them, so such a request is answered by one non-streamed call, and a stream gets
  one event with everything; its tokens carry the version current when it was sent;
* `/get_weights_by_name` reads the parameter from the vLLM worker (`arl_weights_by_name`);
* LoRA adapters (`trainer.lora.publish: adapter`, `lora_adapters.py`): `/load_lora_adapter` and
  `/unload_lora_adapter` become vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`; a request naming
  one (`lora_path`) goes to vLLM as `model: <name>`, and its tokens are labelled with the adapter's version
  (`lora_adapter_version` of its name), the weights that sampled them whatever the server's label says since.
  `/update_weight_version` sets the server's label (`weight_version`), as SGLang's does: nothing is loaded,
  and with `abort_all_requests` the requests in flight are aborted first.

Run: `python -m pipeline.engine.server.vllm.adapter --upstream URL --port N --model-path DIR` (see `procs.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.engine.server.app import build_app
from pipeline.engine.server.backend import Check, Progress, model_info_body
from pipeline.engine.server.requests import Limits, PromptLogprobs, RequestError, WorkItem, stop_token_ids
from pipeline.engine.server.serve import config_from_args, serve, server_parser
from pipeline.engine.server.vllm.checkpoint import checkpoint_eos_ids, checkpoint_shapes
from pipeline.engine.server.vllm.gate import DRAIN_TIMEOUT_S, Gate
from pipeline.engine.server.vllm.lora_adapters import LoraAdapters
from pipeline.engine.server.vllm.wire import choice_tokens, choice_top, completion_body, finish_reason, prompt_scores
from pipeline.engine.server.weights import load_tokenizer
from schemas.engine_api import (
    VERIFY_RID_PREFIX,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
    lora_adapter_version,
)


@dataclass
class AdapterConfig:
    upstream: str
    model_path: str
    tokenizer_path: str | None = None
    served_model_name: str = "arl-policy"
    weight_version: int = 0
    max_context: int = 2048
    tp_size: int = 1
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    """How long a `wait` pause or a weight update waits for the requests in flight to finish."""


class VLLMAdapter:
    """A vLLM server as an `EngineBackend`."""

    failure_status = 502  # an error here is (nearly always) vLLM's: the gateway's status
    incremental_stream = False
    serves_input_logprobs = True

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.model_path = config.model_path
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.checkpoint_shapes = checkpoint_shapes(Path(config.model_path))
        hf_config = json.loads((Path(config.model_path) / "config.json").read_text())
        self.limits = Limits(int(hf_config["vocab_size"]), config.max_context)
        self.eos_ids = checkpoint_eos_ids(Path(config.model_path), hf_config, self.tokenizer)
        self.requests_total = 0
        self.update_lock = asyncio.Lock()
        self.http = httpx.AsyncClient(base_url=config.upstream, timeout=httpx.Timeout(None, connect=10.0))
        self.gate = Gate(self.http, config.weight_version, config.drain_timeout_s)
        self.loras = LoraAdapters(self.http, config.drain_timeout_s)

    # -- generation -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.gate.served_version

    async def generate(self, item: WorkItem, *, stream: bool) -> AsyncGenerator[Progress, None]:
        # Streamed from vLLM whether the caller streams or not: each token's version is the one current when
        # it arrives (gate.py). Prompt logprobs are not streamed by vLLM: one answer (`_scored`).
        scored = item.logprob_start_len >= 0
        if item.routed_experts_start >= 0:
            raise RequestError(
                "return_routed_experts is not served by arl's vLLM adapter: the vLLM CPU build has no routing capture "
                "(serve the model with the hf engine, or SGLang with --enable-return-routed-experts)"
            )
        self.loras.acquire(item.lora)  # an unload of its adapter waits for it
        try:
            await self.gate.admit(probe=_is_probe(item))
            if item.max_new_tokens == 0 and not scored:  # vLLM refuses max_tokens=0; SGLang answers with nothing
                yield self._progress([], [], {"type": "length", "length": 0})
            elif scored:
                yield await self._scored(item)
            else:
                async for progress in self._stream(item):
                    yield progress
        finally:
            self.loras.release(item.lora)

    async def _scored(self, item: WorkItem) -> Progress:
        """A request with prompt logprobs: one non-streamed call. Its tokens are labelled with the version
        current when it was sent (a swap under a frozen scored request is not located within it)."""
        version = self._label(item)
        body = completion_body(item, self._model(item), stream=False, cache_salt=self._salt())
        try:
            resp = await self.gate.upstream(item.rid, self.http.post("/v1/completions", json=body))
        except asyncio.CancelledError:
            if self.gate.was_aborted(item.rid):
                return self._progress([], [], {"type": "abort", "message": "aborted by request"})
            raise
        finally:
            self.gate.done(item.rid)
        choice = _upstream_json(resp)["choices"][0]
        prompt = prompt_scores(choice, item)
        if item.max_new_tokens == 0:  # scored only: vLLM generated one token, which SGLang would not have
            return self._progress([], [], {"type": "length", "length": 0}, prompt=prompt)
        ids, logprobs = choice_tokens(choice)
        finish = finish_reason(choice, ids, stop_token_ids(item.params, self.eos_ids))
        top = choice_top(choice, item.top_logprobs_num)
        return Progress(ids, logprobs, self.gate.sampling_version, finish, top, prompt, [version] * len(ids))

    async def _stream(self, item: WorkItem) -> AsyncIterator[Progress]:
        """vLLM's streamed completion, one event per upstream chunk that carries tokens or the finish.

        Every upstream await goes through the gate, so an abort lands even while vLLM holds the request
        frozen (no chunk comes then); closing the upstream stream makes vLLM abort the request."""
        body = completion_body(item, self._model(item), stream=True, cache_salt=self._salt())
        ids: list[int] = []
        stops = stop_token_ids(item.params, self.eos_ids)
        resp: httpx.Response | None = None
        try:
            request = self.http.build_request("POST", "/v1/completions", json=body)
            resp = await self.gate.upstream(item.rid, self.http.send(request, stream=True))
            if resp.status_code >= 400:
                await resp.aread()
                _upstream_json(resp)
            lines = resp.aiter_lines()
            while (line := await self.gate.upstream(item.rid, anext(lines, None))) is not None:
                payload = line.removeprefix("data:").strip()
                if not line.startswith("data:") or payload == "[DONE]":
                    continue
                choices = json.loads(payload).get("choices") or []
                if not choices:
                    continue
                new_ids, new_lps = choice_tokens(choices[0])
                ids += new_ids
                finish = finish_reason(choices[0], ids, stops)
                top = choice_top(choices[0], item.top_logprobs_num)
                label = [self._label(item)] * len(new_ids)
                yield Progress(new_ids, new_lps, self.gate.sampling_version, finish, top, None, label)
        except asyncio.CancelledError:
            if not self.gate.was_aborted(item.rid):
                raise
            yield self._progress([], [], {"type": "abort", "message": "aborted by request"})
        finally:
            try:
                if resp is not None:
                    await resp.aclose()
            finally:
                self.gate.done(item.rid)

    def _model(self, item: WorkItem) -> str:
        """vLLM's `model` of a request: its LoRA adapter's name (vLLM serves each loaded one as a model)."""
        return item.lora or self.config.served_model_name

    def _label(self, item: WorkItem) -> int:
        """The weight version of the tokens arriving now: an arl adapter's own version (`lora_adapter_name`), which
        a new version, loaded under another name, never changes under a request; else the served weights'."""
        adapter = lora_adapter_version(item.lora) if item.lora else None
        return self.gate.sampling_version if adapter is None else adapter

    def _salt(self) -> str:
        """vLLM's prefix-cache salt: blocks computed by one version are never reused under another (vLLM's
        reset of the prefix cache fails while requests frozen in place hold blocks; gate.py)."""
        return f"arl-v{self.gate.sampling_version}"

    def _progress(
        self, ids: list[int], lps: list[float], finish: dict[str, Any] | None, prompt: PromptLogprobs | None = None
    ) -> Progress:
        return Progress(ids, lps, self.gate.sampling_version, finish, [], prompt)

    async def health(self, *, generate: bool) -> Check:
        # `generate` or not, the same question: vLLM's /health answers only while its engine runs.
        try:
            resp = await self.http.get("/health", timeout=5.0)
        except Exception as exc:
            return Check(False, f"vLLM server unreachable: {exc}")
        return Check(resp.status_code == 200)

    # -- control ----------------------------------------------------------------------------
    async def abort(self, rid: str | None, message: str) -> None:
        self.gate.abort(rid)

    async def pause(self, mode: str) -> str:
        return await self.gate.pause(mode)

    async def resume(self) -> None:
        await self.gate.resume()

    async def flush_cache(self) -> Check:
        # vLLM answers 200 with `success: false` when it refuses (blocks in use, e.g. by frozen requests).
        resp = await self.http.post("/reset_prefix_cache")
        return Check(resp.status_code < 400 and resp.json().get("success") is not False, "Cache flushed.\n")

    # -- weights ----------------------------------------------------------------------------
    async def update_from_disk(self, model_path: str, version: int | None, abort_all: bool) -> str:
        if not (Path(model_path) / "config.json").exists():
            raise RequestError(f"model_path {model_path!r} is not a Hugging Face model directory")
        if self.gate.updating:
            raise RequestError("a broadcast weight update is open on the vLLM workers: /end_weight_update first")
        async with self.update_lock, self.gate.swapping(abort_all):
            await self._rpc("arl_reload_from_disk", model_path)
            await self._reset_prefix_cache()
            self.gate.set_version(version)
        self.model_path = model_path
        return f"reloaded {model_path}"

    async def join_group(self, body: InitWeightsUpdateGroupReqInput) -> str:
        await self._rpc("arl_init_group", body.model_dump_json())
        return f"joined {body.group_name}"

    async def begin_update(self) -> None:
        """Hold new requests and wait out those in flight (unless vLLM holds them frozen), then open the
        workers' layerwise reload; requests stay held until `end_update`."""
        await self.gate.begin_update()
        try:
            await self._rpc("arl_begin_update")
        except BaseException:
            await self.gate.end_update()
            raise

    async def update_from_group(self, body: UpdateWeightsFromDistributedReqInput, version: int | None) -> str:
        self._vet_names(body)
        names = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes, "group_name": body.group_name}
        await self._rpc("arl_receive", json.dumps(names))  # nothing runs a forward: drained or frozen
        self.gate.set_version(version)
        return f"received {len(body.names)} tensors"

    async def end_update(self) -> None:
        try:
            await self._rpc("arl_end_update")
            await self._reset_prefix_cache()
        finally:
            await self.gate.end_update()

    async def leave_group(self, group_name: str) -> str:
        await self._rpc("arl_destroy_group", group_name)
        return f"destroyed {group_name}"

    async def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache after a swap. vLLM refuses (`success: false`) while requests frozen in place
        hold KV blocks; the cache salt (`_salt`) keeps their blocks from serving another version anyway."""
        await self.http.post("/reset_prefix_cache")

    async def _rpc(self, method: str, *args: str) -> Any:
        resp = await self.http.post("/collective_rpc", json={"method": method, "args": list(args)})
        if resp.status_code >= 400:
            raise RequestError(f"vLLM {method} failed ({resp.status_code}): {resp.text[:2000]}")
        return resp.json() if resp.content else None

    def _vet_names(self, body: UpdateWeightsFromDistributedReqInput) -> None:
        """Refuse unknown names / wrong shapes before the trainer starts broadcasting (checkpoint names)."""
        known = self.checkpoint_shapes
        unknown = [n for n in body.names if n not in known and n != "lm_head.weight"]
        if unknown:
            raise RequestError(f"{len(unknown)} names are not in the served checkpoint, e.g. {unknown[:5]}")
        bad = [(n, s, known[n]) for n, s in zip(body.names, body.shapes, strict=True) if n in known and s != known[n]]
        if bad:
            raise RequestError(f"shape mismatch (name, got, expected): {bad[:5]}")

    async def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """SGLang's `/get_weights_by_name`: the first rows of a served parameter, by its HF name.

        Read from the vLLM worker (`arl_weights_by_name`), which un-fuses vLLM's qkv/gate_up layers.
        With tp_size > 1 each worker holds a shard: refused rather than answering one shard's rows, in SGLang's
        words for a model that cannot answer (`pipeline.trainer.publish.verify.UNSUPPORTED`).
        """
        if self.config.tp_size > 1:  # SGLang's words for "cannot": the trainer then verifies by the probe only
            raise RequestError(
                f"Get parameter by name failed: not supported with tp_size > 1 (tp_size={self.config.tp_size})"
            )
        if name not in self.checkpoint_shapes and name != "lm_head.weight":
            raise RequestError(f"{name!r} is not a parameter of the served checkpoint")
        if self.gate.updating:
            raise RequestError("a broadcast weight update is open on the vLLM workers: /end_weight_update first")
        async with self.update_lock:  # never half-way through a disk update
            spec = json.dumps({"name": name, "truncate_size": truncate_size})
            results = await self._rpc("arl_weights_by_name", spec)
        return list(results["results"][0])

    # -- LoRA adapters (lora_adapters.py) -------------------------------------------------------
    def loaded_adapters(self) -> dict[str, str]:
        return dict(self.loras.loaded)

    async def load_lora_adapter(self, body: LoadLoRAAdapterReqInput) -> dict[str, str]:
        return await self.loras.load(body)

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterReqInput) -> dict[str, str]:
        return await self.loras.unload(body)

    async def update_weight_version(self, body: UpdateWeightVersionReqInput, version: int) -> str:
        """SGLang's relabelling (a LoRA publication, once the new adapter is loaded): nothing is loaded; with
        `abort_all_requests` the requests in flight are aborted first (vLLM's too)."""
        if body.abort_all_requests:
            await self.gate.abort_all()
        self.gate.set_version(version)
        return f"weight version updated to {version}"

    # -- info -------------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        tokenizer = self.config.tokenizer_path or self.model_path
        return model_info_body(self.model_path, tokenizer, self.weight_version, self.limits)

    def server_info(self) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "upstream": self.config.upstream,
            "model_path": self.model_path,
            "tp_size": self.config.tp_size,
            "dp_size": 1,
            "weight_version": str(self.weight_version),
            "paused": self.gate.paused is not None,
            "pause_mode": self.gate.paused,
            "frozen": self.gate.frozen,
            "scores_while_paused": self.gate.frozen is None,
            "running": len(self.gate.inflight),
            "lora_adapters": dict(self.loras.loaded),
        }


def _is_probe(item: WorkItem) -> bool:
    """The trainer's verification probe (`pipeline.engine.client.admin.score_prompt`)."""
    return item.rid.startswith(VERIFY_RID_PREFIX) and item.max_new_tokens == 0 and item.logprob_start_len >= 0


def _upstream_json(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            detail = resp.json()
            message = detail.get("error", {}).get("message") or detail.get("message") or detail
        except ValueError:
            message = resp.text[:2000]
        if resp.status_code < 500:
            raise RequestError(f"vLLM refused the request ({resp.status_code}): {message}")
        raise RuntimeError(f"vLLM failed ({resp.status_code}): {message}")
    return resp.json()


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.engine.server.vllm.adapter --upstream URL --port N --model-path DIR`."""
    from pipeline.run.logs import setup_logging

    parser = server_parser("SGLang-protocol adapter in front of a vLLM server", max_context=2048)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--served-model-name", default="arl-policy")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S)
    args = parser.parse_args(argv)
    setup_logging()
    config = config_from_args(AdapterConfig, args)
    adapter = VLLMAdapter(config)
    serve(build_app(adapter, title="arl vLLM adapter (SGLang protocol)"), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    from pipeline.engine.server.vllm.adapter import main as _main  # the module proper, not __main__'s copy

    raise SystemExit(_main())
