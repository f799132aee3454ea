"""Serving an engine app over HTTP: as a server process's one job, or in a background thread.

`serve` is what the server processes run (`python -m pipeline.engine.server.hf.process`, `... .vllm.adapter`);
`serve_in_thread` serves beside other work in this process, e.g. `hf.start_hf_server` for tests
and benchmarks: real HTTP on loopback, started in about a second, no subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import uvicorn

from pipeline.net.addresses import free_port

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

B = TypeVar("B")
C = TypeVar("C", bound="DataclassInstance")


def serve(app: Any, *, host: str, port: int, **uvicorn_options: Any) -> None:
    """Serve `app` until the process is told to stop (SIGINT / SIGTERM)."""
    options = {"log_level": "warning", "timeout_graceful_shutdown": 5, **uvicorn_options}
    uvicorn.run(app, host=host, port=port, **options)


@dataclass
class ServerHandle(Generic[B]):
    """A server running in a background thread of this process; `stop()` (or leave the `with`) ends it."""

    url: str
    server: B
    """The backend behind the app (e.g. `HFEngine`): tests read its state."""
    _uvicorn: uvicorn.Server
    _thread: threading.Thread
    _on_stop: Callable[[], None]

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)
        self._on_stop()

    def __enter__(self) -> ServerHandle[B]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(
    app: Any,
    server: B,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    on_stop: Callable[[], None] = lambda: None,
    startup_timeout_s: float = 60.0,
) -> ServerHandle[B]:
    """Serve `app` (whose backend is `server`) on its own event loop in a thread; returns once it listens.

    `port` 0 picks a free one; `on_stop` runs after the HTTP server stopped (and if it fails to start).
    """
    port = port or free_port(host)
    uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, name=f"engine-server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            uv.should_exit = True
            on_stop()
            raise RuntimeError(f"server on {host}:{port} did not start within {startup_timeout_s}s (port taken?)")
        time.sleep(0.02)
    return ServerHandle(f"http://{host}:{port}", server, uv, thread, on_stop)


def server_parser(description: str, *, max_context: int | None) -> argparse.ArgumentParser:
    """The arguments every server process takes (each backend adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=max_context)
    return parser


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    """A backend's config dataclass from a server's parsed arguments (flags are named after its fields)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
