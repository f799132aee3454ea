"""The benchmark harness's *instant engine*: a minimal server of the engine protocol (docs/inference.md).

It answers `POST /generate` at once with a fixed token list (log-probability -0.5 each, finish
reason `stop` on the last token), streamed or not, plus `GET /health`, `/model_info` (with the
`weight_version`), `/server_info` and `POST /abort_request`. It does no inference at all: measured through
it, a request's latency is the cost of the proxy (or of the HTTP client) alone. It is a raw ASGI
app on uvicorn with precomputed response bytes, so its own cost is as close to the HTTP floor as
this stack gets. Not a test double: nothing in tests/ uses it; `benchmarks/proxy_overhead.py`
does.

    python benchmarks/instant_engine.py --port 30000 --tokens 17,42,99,503
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]


def make_app(output_ids: list[int], weight_version: int = 0) -> Callable[..., Awaitable[None]]:
    """The ASGI app answering every `/generate` with `output_ids`."""
    meta = {
        "id": "instant", "prompt_tokens": 0, "completion_tokens": len(output_ids),
        "finish_reason": {"type": "stop", "matched": output_ids[-1] if output_ids else None},
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids], "weight_version": str(weight_version),
    }  # fmt: skip
    plain = json.dumps({"text": "", "output_ids": output_ids, "meta_info": meta}).encode()
    streamed = b"data: " + plain + b"\n\ndata: [DONE]\n\n"
    small = {
        b"/health": b"{}",
        b"/model_info": json.dumps(
            {"model_path": "instant", "is_generation": True, "weight_version": str(weight_version)}
        ).encode(),
        b"/server_info": json.dumps({"tp_size": 1}).encode(),
        b"/abort_request": b"{}",
        b"/ping": b"{}",
    }

    async def app(scope: Scope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["raw_path"]
        if path == b"/generate":
            stream = b'"stream": true' in body or b'"stream":true' in body
            payload, ctype = (streamed, b"text/event-stream") if stream else (plain, b"application/json")
        elif path in small:
            payload, ctype = small[path], b"application/json"
        else:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": payload})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tokens", default="17,42,99", help="comma-separated output token ids")
    args = parser.parse_args()
    ids = [int(t) for t in args.tokens.split(",") if t]
    uvicorn.run(make_app(ids), host=args.host, port=args.port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools")  # fmt: skip


if __name__ == "__main__":
    main()
