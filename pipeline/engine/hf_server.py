"""The `hf` backend: a FastAPI server around a transformers model that speaks SGLang's native protocol.

Endpoints (SGLang's names and bodies; see `schemas/engine_api.py` and docs/inference.md):
`POST /generate`, `GET /health`, `GET /health_generate`, `GET /get_model_info`,
`GET /get_server_info`, `GET /get_weight_version`, `POST /flush_cache`, `POST /abort_request`,
`POST /pause_generation`, `POST /continue_generation`, `POST /update_weights_from_disk`,
`POST /init_weights_update_group`, `POST /update_weights_from_distributed`,
`POST /destroy_weights_update_group`.

Every body is validated here; malformed input gets a 400 with `{"error": {"message", "type",
"code"}}` (admin endpoints: SGLang's `{"success": false, "message"}`), never a 5xx. The model lives
in the scheduler thread (`batcher.py`); handlers only enqueue work and await its events.

Run one: `python -m pipeline.engine.hf_server --model-path DIR --port 30000`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from pipeline.engine.hf_admin import register_admin_routes
from pipeline.engine.http_errors import BadRequest, error_response, parse_body
from pipeline.engine.protocol import (
    Limits,
    RequestError,
    TopEntry,
    WorkItem,
    expand,
    response,
    splice_top,
    stop_token_ids,
    top_entries,
)
from schemas.engine_api import GenerateReqInput

log = logging.getLogger("arl.engine.hf_server")


@dataclass
class HFServerConfig:
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


class HFServer:
    """The engine (model + scheduler) and its FastAPI app."""

    def __init__(self, config: HFServerConfig) -> None:
        from pipeline.engine.batcher import Scheduler
        from pipeline.engine.weights import eos_token_ids, load_model, load_tokenizer, resolve_device

        self.config = config
        self.model_path = config.model_path
        self.device = resolve_device(config.device)
        self.model = load_model(config.model_path, device=self.device, dtype=config.dtype)
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        model_max = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.limits = Limits(int(self.model.config.vocab_size), min(config.max_context or model_max, model_max))
        original = config.return_original_logprob or _env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB")
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            max_batch_size=config.max_batch_size,
            max_context=self.limits.max_context,
            eos_ids=self.eos_ids,
            weight_version=config.weight_version,
            return_original_logprob=original,
            seed=config.seed,
        )
        self.weight_groups: dict[str, Any] = {}
        self.requests_total = 0
        self.started_at = time.time()
        self.app = self._build_app()

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # -- app --------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response

        app = FastAPI(title="arl hf engine (SGLang protocol)")

        @app.exception_handler(BadRequest)
        async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
            return error_response(str(exc), 400, admin=exc.admin)

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
            log.exception("unhandled error in a request handler")
            return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return error_response(f"invalid request: {exc.errors()}", 400)

        @app.get("/health")
        async def health() -> Response:
            if not self.scheduler.alive:
                return error_response(f"engine scheduler is not running: {self.scheduler.error}", 503)
            return Response(status_code=200)

        @app.get("/health_generate")
        async def health_generate() -> Response:
            if not self.scheduler.alive:
                return error_response(f"engine scheduler is not running: {self.scheduler.error}", 503)
            if self.scheduler.paused is not None:
                return Response(status_code=200)  # paused on purpose: generation would wait for /continue
            item = WorkItem(f"health-{time.monotonic_ns()}", [self.pad_token()], _health_params(), 1, False)
            try:
                await asyncio.wait_for(self._run(item), timeout=20.0)
            except TimeoutError:
                return error_response("a 1-token generation did not finish within 20 s", 503)
            return Response(status_code=200)

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            self.requests_total += 1
            body = await parse_body(request, GenerateReqInput)
            try:
                items = expand(body, self.limits, self.tokenizer)
            except RequestError as exc:
                raise BadRequest(str(exc)) from None
            if body.stream:
                return self._stream_response(items[0], body.return_text_in_logprobs)
            results = await self._run_until_disconnect(request, items, body.return_text_in_logprobs)
            if results is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            return JSONResponse(results if body.is_batch() or len(results) > 1 else results[0])

        register_admin_routes(app, self)
        return app

    def pad_token(self) -> int:
        return self.scheduler.pad_id

    # -- generation -------------------------------------------------------------------------
    async def _run(self, item: WorkItem, text_in_logprobs: bool = False) -> dict[str, Any]:
        """Submit one work item and wait for its final response."""
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[TopEntry] = []
        async for event in self._events(item):
            ids += event.new_ids
            logprobs += event.new_logprobs
            top += event.new_top
            if event.finish is not None:
                return response(
                    item,
                    ids,
                    logprobs,
                    event.finish,
                    event.weight_version,
                    self.tokenizer,
                    top_logprobs=top,
                    text_in_logprobs=text_in_logprobs,
                )
        raise RuntimeError("engine event stream ended without a finish event")

    async def _events(self, item: WorkItem) -> Any:
        """The scheduler's events for `item`; aborts it on the scheduler if the consumer goes away."""
        from pipeline.engine.batcher import GenRequest, Progress
        from pipeline.engine.sampling import RowSampling

        params = item.params
        queue: asyncio.Queue[Progress] = asyncio.Queue()
        generator = _seeded(params, self.device)
        top_k = item.top_logprobs_num if item.return_logprob else 0  # zero: no top-k work for this row
        sampling = RowSampling(params.temperature, params.top_p, params.top_k, params.min_p, generator, top_k)
        request = GenRequest(
            rid=item.rid,
            input_ids=item.input_ids,
            max_new_tokens=item.max_new_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids(params, self.eos_ids),
            stop_strings=params.stop_strings(),
            loop=asyncio.get_running_loop(),
            events=queue,
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

    async def _run_until_disconnect(
        self, request: Any, items: list[WorkItem], text_in_logprobs: bool
    ) -> list[dict[str, Any]] | None:
        work = asyncio.ensure_future(asyncio.gather(*(self._run(i, text_in_logprobs) for i in items)))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if work in done:
            return list(work.result())
        work.cancel()  # the generators' finally blocks abort the requests on the scheduler
        return None

    def _stream_response(self, item: WorkItem, text_in_logprobs: bool) -> Any:
        from fastapi.responses import StreamingResponse

        return StreamingResponse(self._sse(item, text_in_logprobs), media_type="text/event-stream")

    async def _sse(self, item: WorkItem, text_in_logprobs: bool) -> Any:
        """SSE chunks like SGLang's: cumulative `output_ids`/`text`/logprobs (deltas if incremental)."""
        ids: list[int] = []
        logprobs: list[float] = []
        top_json: list[str] = []  # each position's top logprobs, JSON-encoded once (see splice_top)
        incremental = self.config.incremental_streaming_output
        async for event in self._events(item):
            start = len(ids)
            ids += event.new_ids
            logprobs += event.new_logprobs
            top_json += [json.dumps(e) for e in top_entries(event.new_top, self.tokenizer, text_in_logprobs)]
            if not event.new_ids and event.finish is None:
                continue
            chunk = response(
                item,
                ids,
                logprobs,
                event.finish,
                event.weight_version,
                self.tokenizer,
                text_in_logprobs=text_in_logprobs,
            )
            meta = chunk["meta_info"]
            with_top = meta.pop("output_top_logprobs", None) is not None
            if incremental:
                chunk["output_ids"] = ids[start:]
                chunk["text"] = self.tokenizer.decode(ids[start:], skip_special_tokens=item.params.skip_special_tokens)
                if "output_token_logprobs" in meta:
                    meta["output_token_logprobs"] = meta["output_token_logprobs"][start:]
            body = json.dumps(chunk)
            if with_top:
                body = splice_top(body, top_json[start:] if incremental else top_json)
            yield f"data: {body}\n\n"
        yield "data: [DONE]\n\n"

    # -- info -------------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.scheduler.weight_version),
            "max_context": self.limits.max_context,
            "context_length": self.limits.max_context,
            "vocab_size": self.limits.vocab_size,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
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
            "weight_version": str(self.scheduler.weight_version),
            "paused": self.scheduler.paused,
            "return_original_logprob": self.scheduler.return_original_logprob,
            "incremental_streaming_output": self.config.incremental_streaming_output,
            "started_at": self.started_at,
            "num_requests": self.requests_total,
            **self.scheduler.load(),
        }


async def _wait_disconnect(request: Any) -> None:
    """Returns when the client disconnects (the body is already read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def _seeded(params: Any, device: Any) -> Any:
    if params.sampling_seed is None:
        return None
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(int(params.sampling_seed))
    return generator


def _health_params() -> Any:
    from schemas.engine_api import SamplingParams

    return SamplingParams(max_new_tokens=1, temperature=0.0)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> int:
    """Serve one model: `python -m pipeline.engine.hf_server --model-path DIR --port N` (used by launch.py)."""
    import argparse

    import uvicorn

    from pipeline.logs import setup_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--return-original-logprob", action="store_true")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    args = parser.parse_args(argv)
    # Before torch starts OpenMP: idle OpenMP workers must sleep, not spin. A spinning worker competes
    # with the event-loop thread for the cores (and the GIL hand-offs between them), which made CPU
    # decoding ~15x slower on a busy 2-core machine (measured: 64 tokens in 7.6 s vs 0.5 s).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    setup_logging()
    config = HFServerConfig(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_context=args.max_context,
        weight_version=args.weight_version,
        seed=args.seed,
        return_original_logprob=args.return_original_logprob,
        incremental_streaming_output=args.incremental_streaming_output,
    )
    server = HFServer(config)
    server.start()
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    # Import the module proper, so its classes are the ones every other module sees (not `__main__`'s copies).
    from pipeline.engine.hf_server import main as _main

    raise SystemExit(_main())
