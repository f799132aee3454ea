"""The `vllm` backend: SGLang's protocol (the engine app, `app.py`) in front of a vLLM OpenAI server.

The engine client, proxy and trainer keep speaking SGLang's protocol; this backend turns each
completion into a token-in/token-out `/v1/completions` call (see `vllm_wire.py`) and the admin
commands into vLLM calls:

* weight updates and the broadcast group: `/collective_rpc` into `vllm_worker_ext.ArlWorkerExtension`
  (vLLM runs with VLLM_SERVER_DEV_MODE=1). Like SGLang, a disk update waits for the requests in flight
  to finish (new ones wait), or aborts them with `abort_all_requests`; then the prefix cache is
  reset and `weight_version` bumped. A broadcast session (`/begin_weight_update` ... `/end_weight_update`)
  waits for them at its begin and holds new requests until its end: the workers' layers are being
  replaced in between (vLLM's layerwise reload), and the prefix cache is reset at the end;
* pause holds *new* requests until resume (mode `abort` also aborts those in flight); vLLM offers
  no way to freeze a running request from outside, so requests already in flight run to completion.
  The trainer's verification probe (`rid` prefix `VERIFY_RID_PREFIX`, prompt scoring, nothing
  generated) runs while paused, as on the hf engine, but never during a weight update;
* abort cancels the upstream HTTP call, which makes vLLM abort the request;
* input logprobs (`logprob_start_len` >= 0) are vLLM's prompt logprobs (see `vllm_wire.py`); vLLM
  does not stream them, so such a request is answered by one non-streamed call, and a stream gets
  one event with everything;
* `/get_weights_by_name` reads the parameter from the vLLM worker (`arl_weights_by_name`).

Run: `python -m pipeline.engine.server.vllm_adapter --upstream URL --port N --model-path DIR` (see `procs.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.engine.server.app import build_app
from pipeline.engine.server.backend import Check, Progress, model_info_body
from pipeline.engine.server.requests import Limits, PromptLogprobs, RequestError, WorkItem, stop_token_ids
from pipeline.engine.server.serve import config_from_args, serve, server_parser
from pipeline.engine.server.vllm_wire import choice_tokens, choice_top, completion_body, finish_reason, prompt_scores
from pipeline.engine.server.weights import eos_token_ids, load_tokenizer
from schemas.engine_api import VERIFY_RID_PREFIX, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput


@dataclass
class AdapterConfig:
    upstream: str
    model_path: str
    tokenizer_path: str | None = None
    served_model_name: str = "arl-policy"
    weight_version: int = 0
    max_context: int = 2048
    tp_size: int = 1


class VLLMAdapter:
    """A vLLM server as an `EngineBackend`."""

    failure_status = 502  # an error here is (nearly always) vLLM's: the gateway's status
    incremental_stream = False
    serves_input_logprobs = True

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.model_path = config.model_path
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.checkpoint_shapes = _checkpoint_shapes(Path(config.model_path))
        hf_config = json.loads((Path(config.model_path) / "config.json").read_text())
        self.limits = Limits(int(hf_config["vocab_size"]), config.max_context)
        self.eos_ids = eos_token_ids(
            _ConfigView(hf_config, _generation_config(Path(config.model_path))), self.tokenizer
        )
        self.weight_version = config.weight_version
        self.requests_total = 0
        self.open = asyncio.Event()
        self.open.set()
        self.paused = False
        self.steady = asyncio.Event()
        """No weight update runs (the verification probe waits only for this)."""
        self.steady.set()
        self.updating = False
        """A broadcast session is open: requests are held whatever `/continue_generation` says."""
        self.inflight: dict[str, asyncio.Future[Any]] = {}
        self.aborted: set[str] = set()
        self.update_lock = asyncio.Lock()
        self.http = httpx.AsyncClient(base_url=config.upstream, timeout=httpx.Timeout(None, connect=10.0))

    # -- generation -------------------------------------------------------------------------
    async def generate(self, item: WorkItem, *, stream: bool) -> AsyncGenerator[Progress, None]:
        await _until_set(self.steady if _is_probe(item) else self.open)
        if not stream or item.logprob_start_len >= 0:  # vLLM streams no prompt logprobs
            yield await self._complete(item)
            return
        async for progress in self._stream(item):
            yield progress

    async def _complete(self, item: WorkItem) -> Progress:
        scored = item.logprob_start_len >= 0
        if item.max_new_tokens == 0 and not scored:  # vLLM refuses max_tokens=0; SGLang answers with nothing
            return self._progress([], [], {"type": "length", "length": 0})
        body = completion_body(item, self.config.served_model_name, stream=False)
        upstream = asyncio.ensure_future(self.http.post("/v1/completions", json=body))
        self.inflight[item.rid] = upstream
        try:
            resp = await upstream
        except asyncio.CancelledError:
            if item.rid in self.aborted and not _current_task_cancelling():
                return self._progress([], [], {"type": "abort", "message": "aborted by request"})
            upstream.cancel()
            raise
        finally:
            self.inflight.pop(item.rid, None)
            self.aborted.discard(item.rid)
        choice = _upstream_json(resp)["choices"][0]
        prompt = prompt_scores(choice, item) if scored else None
        if item.max_new_tokens == 0:  # scored only: vLLM generated one token, which SGLang would not have
            return self._progress([], [], {"type": "length", "length": 0}, prompt=prompt)
        ids, logprobs = choice_tokens(choice)
        finish = finish_reason(choice, ids, stop_token_ids(item.params, self.eos_ids))
        return self._progress(ids, logprobs, finish, choice_top(choice, item.top_logprobs_num), prompt)

    async def _stream(self, item: WorkItem) -> AsyncIterator[Progress]:
        """vLLM's streamed completion, one event per upstream chunk that carries tokens or the finish."""
        body = completion_body(item, self.config.served_model_name, stream=True)
        ids: list[int] = []
        stops = stop_token_ids(item.params, self.eos_ids)
        self.inflight[item.rid] = asyncio.ensure_future(asyncio.sleep(0))  # abortable marker (see abort)
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _upstream_json(resp)
                async for line in resp.aiter_lines():
                    if item.rid in self.aborted:
                        yield self._progress([], [], {"type": "abort", "message": "aborted"})
                        break
                    payload = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or payload == "[DONE]":
                        continue
                    choices = json.loads(payload).get("choices") or []
                    if not choices:
                        continue
                    new_ids, new_lps = choice_tokens(choices[0])
                    ids += new_ids
                    finish = finish_reason(choices[0], ids, stops)
                    yield self._progress(new_ids, new_lps, finish, choice_top(choices[0], item.top_logprobs_num))
        finally:
            self.inflight.pop(item.rid, None)
            self.aborted.discard(item.rid)

    def _progress(
        self, ids: list[int], lps: list[float], finish: dict[str, Any] | None, top: Any = None,
        prompt: PromptLogprobs | None = None,
    ) -> Progress:  # fmt: skip
        return Progress(ids, lps, self.weight_version, finish, top or [], prompt)

    async def health(self, *, generate: bool) -> Check:
        # `generate` or not, the same question: vLLM's /health answers only while its engine runs.
        try:
            resp = await self.http.get("/health", timeout=5.0)
        except Exception as exc:
            return Check(False, f"vLLM server unreachable: {exc}")
        return Check(resp.status_code == 200)

    # -- control ----------------------------------------------------------------------------
    async def abort(self, rid: str | None, message: str) -> None:
        self._abort(rid)

    def _abort(self, rid: str | None) -> int:
        rids = list(self.inflight) if rid is None else [r for r in self.inflight if r == rid or r.startswith(f"{rid}_")]
        for r in rids:
            self.aborted.add(r)
            self.inflight[r].cancel()
        return len(rids)

    async def pause(self, mode: str) -> str:
        self.paused = True
        self.open.clear()
        if mode == "abort":
            self._abort(None)
        return f"new requests held (mode {mode})"

    async def resume(self) -> None:
        self.paused = False
        if not self.updating:
            self.open.set()

    async def flush_cache(self) -> Check:
        resp = await self.http.post("/reset_prefix_cache")
        return Check(resp.status_code < 400, "Cache flushed.\n")

    # -- weights ----------------------------------------------------------------------------
    async def update_from_disk(self, model_path: str, version: int | None, abort_all: bool) -> str:
        if not (Path(model_path) / "config.json").exists():
            raise RequestError(f"model_path {model_path!r} is not a Hugging Face model directory")
        if self.updating:
            raise RequestError("a broadcast weight update is open on the vLLM workers: /end_weight_update first")
        await self._swap(abort_all, version, "arl_reload_from_disk", model_path)
        self.model_path = model_path
        return f"reloaded {model_path}"

    async def join_group(self, body: InitWeightsUpdateGroupReqInput) -> str:
        await self._rpc("arl_init_group", body.model_dump_json())
        return f"joined {body.group_name}"

    async def begin_update(self) -> None:
        """Hold new requests and wait out those in flight (vLLM cannot pause them), then open the workers'
        layerwise reload; requests stay held until `end_update`."""
        self.updating = True
        self.open.clear()
        self.steady.clear()
        try:
            await self._drain(abort_all=False)
            if self.inflight:
                raise RequestError(f"{len(self.inflight)} requests still run after the drain deadline; retry")
            await self._rpc("arl_begin_update")
        except BaseException:
            self._stop_updating()
            raise

    async def update_from_group(self, body: UpdateWeightsFromDistributedReqInput, version: int | None) -> str:
        self._vet_names(body)
        names = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes, "group_name": body.group_name}
        await self._rpc("arl_receive", json.dumps(names))  # no request runs: begin_update drained them
        self.weight_version = self.weight_version if version is None else version
        return f"received {len(body.names)} tensors"

    async def end_update(self) -> None:
        try:
            await self._rpc("arl_end_update")
            await self.http.post("/reset_prefix_cache")
        finally:
            self._stop_updating()

    def _stop_updating(self) -> None:
        self.updating = False
        self.steady.set()
        if not self.paused:
            self.open.set()

    async def leave_group(self, group_name: str) -> str:
        await self._rpc("arl_destroy_group", group_name)
        return f"destroyed {group_name}"

    async def _swap(self, abort_all: bool, version: int | None, method: str, arg: str) -> None:
        """Run a weight-loading RPC with no request in flight (SGLang's update semantics), then reset the cache."""
        async with self.update_lock:
            self.steady.clear()
            try:
                await self._drain(abort_all)
                await self._rpc(method, arg)
                await self.http.post("/reset_prefix_cache")
            finally:
                self.steady.set()
                if not self.paused and not self.updating:
                    self.open.set()
            self.weight_version = self.weight_version if version is None else version

    async def _drain(self, abort_all: bool, timeout_s: float = 600.0) -> None:
        """Hold new requests; abort or wait out those in flight."""
        self.open.clear()
        if abort_all:
            self._abort(None)
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

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
        words for a model that cannot answer (`pipeline.trainer.verify.UNSUPPORTED`).
        """
        if self.config.tp_size > 1:  # SGLang's words for "cannot": the trainer then verifies by the probe only
            raise RequestError(
                f"Get parameter by name failed: not supported with tp_size > 1 (tp_size={self.config.tp_size})"
            )
        if name not in self.checkpoint_shapes and name != "lm_head.weight":
            raise RequestError(f"{name!r} is not a parameter of the served checkpoint")
        if self.updating:
            raise RequestError("a broadcast weight update is open on the vLLM workers: /end_weight_update first")
        async with self.update_lock:  # never half-way through a disk update
            spec = json.dumps({"name": name, "truncate_size": truncate_size})
            results = await self._rpc("arl_weights_by_name", spec)
        return list(results["results"][0])

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
            "paused": self.paused,
            "running": len(self.inflight),
        }


def _is_probe(item: WorkItem) -> bool:
    """The trainer's verification probe (`pipeline.engine.client.admin.score_prompt`)."""
    return item.rid.startswith(VERIFY_RID_PREFIX) and item.max_new_tokens == 0 and item.logprob_start_len >= 0


async def _until_set(event: asyncio.Event) -> None:
    """Wait for `event`, and for it to be set still when this task runs on (another may clear it between)."""
    while not event.is_set():
        await event.wait()


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())


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


class _ConfigView:
    """Just enough of a model for `eos_token_ids` (the adapter never loads the weights)."""

    def __init__(self, hf_config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> None:
        self.config = type("C", (), {"eos_token_id": hf_config.get("eos_token_id")})()
        self.generation_config = (
            type("G", (), {"eos_token_id": generation_config.get("eos_token_id")})() if generation_config else None
        )


def _generation_config(model_dir: Path) -> dict[str, Any] | None:
    """generation_config.json: its EOS ids end vLLM's completions too (as they do the hf engine's)."""
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor names and shapes of a HF checkpoint (headers only): to vet distributed updates up front."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.engine.server.vllm_adapter --upstream URL --port N --model-path DIR`."""
    from pipeline.logs import setup_logging

    parser = server_parser("SGLang-protocol adapter in front of a vLLM server", max_context=2048)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--served-model-name", default="arl-policy")
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args(argv)
    setup_logging()
    config = config_from_args(AdapterConfig, args)
    adapter = VLLMAdapter(config)
    serve(build_app(adapter, title="arl vLLM adapter (SGLang protocol)"), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    from pipeline.engine.server.vllm_adapter import main as _main  # the module proper, not __main__'s copy

    raise SystemExit(_main())
