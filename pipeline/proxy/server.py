"""The capture proxy server: FastAPI app, uvicorn inside the caller's event loop, idle sweeps.

    proxy = ProxyServer(model_cfg, proxy_cfg, engine_client, admin_key=key)
    url = await proxy.start()          # http://127.0.0.1:<port>
    ...                                # agents use url + "/v1" and a session key
    await proxy.stop()

The caller owns the `EngineClient` (it is started here if needed, never closed here). Endpoints
and keys: docs/proxy.md. The process serving the proxy drives its sessions through `proxy.control`
(`pipeline.proxy.local.LocalControl`), agents and operators over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.responses import Response, StreamingResponse

from pipeline.engine.client import EngineClient
from pipeline.net.addresses import PeerLog, public_host
from pipeline.net.apidoc import publish
from pipeline.proxy import anthropic_messages, openai_chat, openai_responses, rl
from pipeline.proxy import openapi as doc
from pipeline.proxy.auth import ROUTE_KEYS, KeyCheck, caller_of, check_routes, note_refusal
from pipeline.proxy.capacity import Capacity
from pipeline.proxy.control import RUN_STATUS_HEADER
from pipeline.proxy.core import Generator
from pipeline.proxy.fields import refuse_unhonoured
from pipeline.proxy.http import BodyLimit, RawPost, add_raw_posts, install_error_handlers, json_response, parse_body
from pipeline.proxy.local import LocalControl
from pipeline.proxy.parsers import check_parser_names
from pipeline.proxy.sessions import Caller, KeyKind, Session, SessionStore
from pipeline.proxy.streaming import SSE_HEADERS
from pipeline.proxy.tokenize import ChatTokenizer
from schemas.api.anthropic import MessagesRequest
from schemas.api.openai_chat import ChatCompletionRequest
from schemas.api.openai_responses import ResponsesRequest
from schemas.api.rl import (
    AnyAgentFinalize,
    AnyAgentSetReward,
    EndSessionRequest,
    ExportRequest,
    GrantCapacityRequest,
    SetRewardRequest,
    StartSessionRequest,
)
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

log = logging.getLogger("arl.proxy")


class ProxyServer:
    """See the module docstring."""

    def __init__(
        self,
        model: ModelConfig,
        proxy: ProxyConfig,
        engine: EngineClient,
        *,
        admin_key: str,
        capacity: Capacity | None = None,
        worker: int | None = None,
    ) -> None:
        """`capacity` and `worker`: set when this is one worker of a pool (`pipeline.proxy.pool`)."""
        check_parser_names(model.tool_parser, model.reasoning_parser)
        self.model = model
        self.config = proxy
        self.engine = engine
        self.tokenizer = ChatTokenizer(
            model.tokenizer or model.path,
            model.chat_template,
            model_dir=model.path,
            special_tokens_in_content=proxy.special_tokens_in_content,
        )
        self.store = SessionStore(proxy, admin_key, capacity=capacity, worker=worker)
        self.control = LocalControl(self.store)
        self.generator = Generator(self.tokenizer, engine, model, proxy)
        self.route_keys: dict[str, tuple[KeyKind, ...]] = dict(ROUTE_KEYS)
        self.app = build_app(self)
        self._server: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self.url: str | None = None

    # -- auth -------------------------------------------------------------------------------
    def protect(self, path: str, *kinds: KeyKind) -> None:
        """Give a route added to `self.app` after construction its key rule (checked by `auth.KeyCheck`)."""
        self.route_keys[path] = kinds

    def session_for_call(self, request: Request) -> Session:
        """The open session behind a session key (LLM calls): 410 once it has ended, before the body is read."""
        session = caller_of(request).session
        assert session is not None  # KeyCheck admits only session keys on these routes
        self.store.check_open(session)
        session.touch()
        return session

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve on `proxy.host:proxy.port` (0 = a free port) inside the running loop; return the base URL."""
        import uvicorn

        check_routes(self.app, self.route_keys)
        freeze_startup_heap()
        await self.engine.start()
        # proxy_headers off: nothing reads the client address, and it is one more layer per request.
        config = uvicorn.Config(
            self.app,
            host=self.config.host,
            port=self.config.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=60,
            proxy_headers=False,
        )
        server = _embedded_server(config)
        self._server = server
        self._serve_task = asyncio.create_task(server.serve(), name="proxy-uvicorn")
        deadline = time.monotonic() + 30.0
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the bind error
                raise RuntimeError(f"proxy server exited during start-up on {self.config.host}:{self.config.port}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy did not start listening on {self.config.host}:{self.config.port} in 30 s")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        # The URL other processes and nodes dial: with `host: 0.0.0.0`, this node's name, never "0.0.0.0".
        self.url = f"http://{public_host(self.config.host)}:{port}"
        self._sweep_task = asyncio.create_task(self._sweep_loop(), name="proxy-session-sweep")
        log.info("proxy serving %s on %s", self.model.served_name, self.url)
        return self.url

    async def stop(self) -> None:
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep_task
            self._sweep_task = None
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            await self._serve_task
            self._server, self._serve_task = None, None

    async def _sweep_loop(self) -> None:
        interval = min(max(self.config.session_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.store.sweep()
            except Exception:  # a bug; the sweeps to come must still run
                log.exception("idle session sweep failed")


_heap_frozen = False


def freeze_startup_heap() -> None:
    """Move every object alive now out of the cyclic GC's sight, once per process.

    A proxy process holds a few hundred thousand long-lived objects from start-up (torch,
    transformers, the tokenizer) and keeps adding sessions; each full collection scanned them all,
    stopping the event loop ~0.2 s and costing ~0.4 ms of CPU per completion on average
    (benchmarks/proxy_overhead.py). Collecting first means only live objects are frozen; frozen
    objects are still freed by reference counting, only cycles among them would stay.
    """
    global _heap_frozen
    if not _heap_frozen:
        gc.collect()
        gc.freeze()
        _heap_frozen = True


def _embedded_server(config: Any) -> Any:
    """A uvicorn.Server that leaves the host process's signal handlers alone (it is not the main program)."""
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return EmbeddedServer(config)


def build_app(proxy: ProxyServer) -> FastAPI:
    app = FastAPI(
        title="arl capture proxy",
        version="1",
        docs_url=None,
        redoc_url=None,
        description="OpenAI/Anthropic-compatible proxy recording exact tokens for RL (docs/proxy.md).",
    )
    install_error_handlers(app, note_refusal)
    app.add_middleware(BodyLimit, max_bytes=proxy.config.max_request_bytes)
    # Added last, so it runs first: a request without a valid key learns nothing about bodies or limits.
    app.add_middleware(KeyCheck, store=proxy.store, routes=proxy.route_keys)
    app.add_middleware(PeerLog, logger=log, what="proxy")  # where agents really call from (docs/operations.md)
    _add_info_routes(app, proxy)
    _add_session_routes(app, proxy)
    add_raw_posts(app, _llm_routes(proxy))
    publish(app, doc.EVENT_MODELS)  # 400 where FastAPI would say 422; the streams' event models
    return app


# The key kinds of each route are in auth.ROUTE_KEYS, checked before the body is read.
_CALLER = Depends(caller_of)


def _add_info_routes(app: FastAPI, proxy: ProxyServer) -> None:
    """`/health` and `/v1/models`."""
    served = proxy.model.served_name

    @app.get("/health", response_model=None, responses=doc.HEALTH)
    async def health() -> Response:
        return json_response({"status": "ok", "model": served, "open_sessions": proxy.store.open_count()})

    @app.get("/v1/models", response_model=None, responses=doc.MODELS)
    async def models(caller: Caller = _CALLER) -> Response:
        return json_response({"object": "list", "data": [_model_entry(served, proxy.model.max_context)]})


def _model_entry(served: str, max_context: int) -> dict[str, Any]:
    """The one model of `/v1/models`, with OpenAI's and Anthropic's fields both."""
    return {
        "id": served,
        "object": "model",
        "created": 0,
        "owned_by": "arl",
        "type": "model",
        "display_name": served,
        "created_at": "1970-01-01T00:00:00Z",
        "max_model_len": max_context,
    }


def _add_session_routes(app: FastAPI, proxy: ProxyServer) -> None:
    """Capacity, the session lifecycle (`/rl/...`, the any-agent `/rl/v1/...`) and the export."""

    @app.post("/grant_capacity", response_model=None, responses=doc.GRANT)
    async def grant_capacity(caller: Caller = _CALLER, body: GrantCapacityRequest | None = None) -> Response:
        available = proxy.store.grant((body or GrantCapacityRequest()).count)
        return json_response({"available": available})

    @app.post("/rl/start_session", response_model=None, responses=doc.START)
    async def start_session(caller: Caller = _CALLER, body: StartSessionRequest | None = None) -> Response:
        return json_response(rl.start_session(proxy.store, caller, body))

    @app.post("/rl/set_reward", response_model=None, responses=doc.SET_REWARD)
    async def set_reward(body: SetRewardRequest, caller: Caller = _CALLER) -> Response:
        return json_response(rl.set_reward(proxy.store, caller, body))

    @app.post("/rl/end_session", response_model=None, responses=doc.END)
    async def end_session(
        request: Request, caller: Caller = _CALLER, body: EndSessionRequest | None = None
    ) -> Response:
        return json_response(await rl.end_session(proxy.store, caller, body, "end_session", _run_status(request)))

    @app.post("/export_trajectories", response_model=None, responses=doc.EXPORT)
    async def export_trajectories(body: ExportRequest, caller: Caller = _CALLER) -> Response:
        return json_response(await rl.export(proxy.store, caller, body))

    @app.post("/rl/v1/set_reward", response_model=None, responses=doc.SET_REWARD)
    async def any_agent_set_reward(body: AnyAgentSetReward, caller: Caller = _CALLER) -> Response:
        return json_response(rl.any_agent_set_reward(proxy.store, caller, body))

    @app.post("/rl/v1/finalize", response_model=None, responses=doc.END)
    async def any_agent_finalize(request: Request, body: AnyAgentFinalize, caller: Caller = _CALLER) -> Response:
        return json_response(await rl.finalize(proxy.store, caller, body, _run_status(request)))


def _run_status(request: Request) -> str:
    """The end call's `x-arl-run-status` ("failed" / "rejected" drop the samples where a spool listens)."""
    return request.headers.get(RUN_STATUS_HEADER) or "ok"


def _llm_routes(proxy: ProxyServer) -> list[RawPost]:
    """The LLM calls: the hot path, served without FastAPI's request handling (see http.add_raw_posts)."""
    served = proxy.model.served_name

    async def chat_completions(request: Request) -> Response:
        session = proxy.session_for_call(request)
        body = await parse_body(request, ChatCompletionRequest)
        refuse_unhonoured("chat", body, proxy.config.ignore_fields)
        spec = openai_chat.to_spec(body)
        cid, ids = openai_chat.new_ids(spec.n)
        session.completions[cid] = ids
        if body.stream:
            items = await proxy.generator.stream(session, spec, ids)
            return _sse(openai_chat.stream_body(cid, served, body, items, proxy.tokenizer))
        done = await proxy.generator.complete(session, spec, ids)
        return json_response(openai_chat.response_body(cid, served, body, done, proxy.tokenizer))

    async def responses(request: Request) -> Response:
        session = proxy.session_for_call(request)
        body = await parse_body(request, ResponsesRequest)
        refuse_unhonoured("responses", body, proxy.config.ignore_fields)
        return await openai_responses.handle(proxy.generator, session, body, served)

    async def messages(request: Request) -> Response:
        session = proxy.session_for_call(request)
        body = await parse_body(request, MessagesRequest)
        refuse_unhonoured("messages", body, proxy.config.ignore_fields)
        return await anthropic_messages.handle(proxy.generator, session, body, served)

    return [
        RawPost("/v1/chat/completions", chat_completions, ChatCompletionRequest, *doc.CHAT),
        RawPost("/v1/responses", responses, ResponsesRequest, *doc.RESPONSES),
        RawPost("/v1/messages", messages, MessagesRequest, *doc.MESSAGES),
    ]


def _sse(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
