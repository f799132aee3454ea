"""SGLang-protocol adapter in front of a vLLM OpenAI server (the `vllm` backend's public face).

The engine client, proxy and trainer keep speaking SGLang's protocol; this process turns
`/generate` into token-in/token-out `/v1/completions` calls (see `vllm_wire.py`) and the admin
endpoints into vLLM calls:

* `/update_weights_from_disk`, `/init_weights_update_group`, `/update_weights_from_distributed`:
  `/collective_rpc` into `vllm_worker_ext.ArlWorkerExtension` (vLLM runs with VLLM_SERVER_DEV_MODE=1).
  Like SGLang, an update waits for the requests in flight to finish (new ones wait), or aborts
  them with `abort_all_requests`; then the prefix cache is reset and `weight_version` bumped.
* `/pause_generation` holds *new* requests until `/continue_generation` (mode `abort` also aborts
  those in flight); vLLM offers no way to freeze a running request from outside, so requests
  already in flight run to completion.
* `/abort_request` cancels the upstream HTTP call, which makes vLLM abort the request.

Run: `python -m pipeline.engine.vllm_adapter --upstream URL --port N --model-path DIR` (launch.py does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.engine.http_errors import BadRequest
from pipeline.engine.protocol import (
    Limits,
    TopEntry,
    WorkItem,
    finish_text,
    splice_top,
    stop_token_ids,
    top_entries,
)
from pipeline.engine.vllm_wire import choice_tokens, choice_top, completion_body, finish_reason

log = logging.getLogger("arl.engine.vllm_adapter")


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
    def __init__(self, config: AdapterConfig) -> None:
        from pipeline.engine.weights import eos_token_ids, load_tokenizer

        self.config = config
        self.model_path = config.model_path
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.checkpoint_shapes = _checkpoint_shapes(Path(config.model_path))
        hf_config = json.loads((Path(config.model_path) / "config.json").read_text())
        self.limits = Limits(int(hf_config["vocab_size"]), config.max_context)
        self.eos_ids = eos_token_ids(_ConfigView(hf_config), self.tokenizer)
        self.weight_version = config.weight_version
        self.open = asyncio.Event()
        self.open.set()
        self.paused = False
        self.inflight: dict[str, asyncio.Future[Any]] = {}
        self.aborted: set[str] = set()
        self.update_lock = asyncio.Lock()
        self.http = httpx.AsyncClient(base_url=config.upstream, timeout=httpx.Timeout(None, connect=10.0))
        self.app = self._build_app()

    # -- generation -------------------------------------------------------------------------
    async def complete(self, item: WorkItem) -> dict[str, Any]:
        await self.open.wait()
        if item.max_new_tokens == 0:  # vLLM refuses max_tokens=0; SGLang answers with nothing generated
            return self._response(item, [], [], {"type": "length", "length": 0})
        body = completion_body(item, self.config.served_model_name, stream=False)
        upstream = asyncio.ensure_future(self.http.post("/v1/completions", json=body))
        self.inflight[item.rid] = upstream
        try:
            resp = await upstream
        except asyncio.CancelledError:
            if item.rid in self.aborted and not _current_task_cancelling():
                return self._response(item, [], [], {"type": "abort", "message": "aborted by request"})
            upstream.cancel()
            raise
        finally:
            self.inflight.pop(item.rid, None)
            self.aborted.discard(item.rid)
        data = _upstream_json(resp)
        choice = data["choices"][0]
        ids, logprobs = choice_tokens(choice)
        finish = finish_reason(choice, ids, stop_token_ids(item.params, self.eos_ids))
        return self._response(item, ids, logprobs, finish, choice_top(choice, item.top_logprobs_num))

    async def stream(self, item: WorkItem) -> Any:
        """SGLang SSE (cumulative chunks) from vLLM's streamed completion."""
        await self.open.wait()
        body = completion_body(item, self.config.served_model_name, stream=True)
        ids: list[int] = []
        logprobs: list[float] = []
        top_json: list[str] = []  # each position's top logprobs encoded once (see protocol.splice_top)
        stops = stop_token_ids(item.params, self.eos_ids)
        self.inflight[item.rid] = asyncio.ensure_future(asyncio.sleep(0))  # abortable marker (see abort)
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _upstream_json(resp)
                async for line in resp.aiter_lines():
                    if item.rid in self.aborted:
                        yield _sse(
                            self._response(item, ids, logprobs, {"type": "abort", "message": "aborted"}), top_json
                        )
                        break
                    payload = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or payload == "[DONE]":
                        continue
                    choices = json.loads(payload).get("choices") or []
                    if not choices:
                        continue
                    new_ids, new_lps = choice_tokens(choices[0])
                    ids += new_ids
                    logprobs += new_lps
                    new_top = top_entries(choice_top(choices[0], item.top_logprobs_num), self.tokenizer, False)
                    top_json += [json.dumps(position) for position in new_top]
                    finish = finish_reason(choices[0], ids, stops)
                    if new_ids or finish is not None:
                        yield _sse(self._response(item, ids, logprobs, finish), top_json)
        finally:
            self.inflight.pop(item.rid, None)
            self.aborted.discard(item.rid)
        yield "data: [DONE]\n\n"

    def _response(
        self,
        item: WorkItem,
        ids: list[int],
        lps: list[float],
        finish: dict[str, Any] | None,
        top: list[TopEntry] | None = None,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": str(self.weight_version),
        }
        if item.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(lps, ids, strict=True)]
            if item.top_logprobs_num > 0:
                meta["output_top_logprobs"] = top_entries(top or [], self.tokenizer, False)
        raw = self.tokenizer.decode(ids, skip_special_tokens=item.params.skip_special_tokens)
        return {"text": finish_text(raw, finish, item.params), "output_ids": ids, "meta_info": meta}

    # -- control ----------------------------------------------------------------------------
    def abort(self, rid: str | None) -> int:
        rids = list(self.inflight) if rid is None else [r for r in self.inflight if r == rid or r.startswith(f"{rid}_")]
        for r in rids:
            self.aborted.add(r)
            self.inflight[r].cancel()
        return len(rids)

    async def drain(self, abort_all: bool, timeout_s: float = 600.0) -> None:
        """Hold new requests; abort or wait out those in flight (SGLang's update semantics)."""
        self.open.clear()
        if abort_all:
            self.abort(None)
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def reopen(self) -> None:
        if not self.paused:
            self.open.set()

    async def rpc(self, method: str, *args: str) -> Any:
        resp = await self.http.post("/collective_rpc", json={"method": method, "args": list(args)})
        if resp.status_code >= 400:
            raise BadRequest(f"vLLM {method} failed ({resp.status_code}): {resp.text[:2000]}", admin=True)
        return resp.json() if resp.content else None

    def _build_app(self) -> Any:
        from pipeline.engine.vllm_routes import register_routes

        return register_routes(self)


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
        raise (
            BadRequest(f"vLLM refused the request ({resp.status_code}): {message}")
            if resp.status_code < 500
            else RuntimeError(f"vLLM failed ({resp.status_code}): {message}")
        )
    return resp.json()


def _sse(obj: dict[str, Any], top_json: list[str]) -> str:
    with_top = obj["meta_info"].pop("output_top_logprobs", None) is not None
    body = json.dumps(obj)
    return f"data: {splice_top(body, top_json) if with_top else body}\n\n"


class _ConfigView:
    """Just enough of a model for `eos_token_ids` (the adapter never loads the weights)."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        self.config = type("C", (), {"eos_token_id": hf_config.get("eos_token_id")})()
        self.generation_config = None


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
    """`python -m pipeline.engine.vllm_adapter --upstream URL --port N --model-path DIR`."""
    import argparse

    import uvicorn

    from pipeline.logs import setup_logging

    parser = argparse.ArgumentParser(description="SGLang-protocol adapter in front of a vLLM server")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--served-model-name", default="arl-policy")
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args(argv)
    setup_logging()
    config = AdapterConfig(
        upstream=args.upstream,
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        served_model_name=args.served_model_name,
        weight_version=args.weight_version,
        max_context=args.max_context,
        tp_size=args.tp_size,
    )
    adapter = VLLMAdapter(config)
    uvicorn.run(adapter.app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    from pipeline.engine.vllm_adapter import main as _main  # the module proper, not __main__'s copy

    raise SystemExit(_main())
