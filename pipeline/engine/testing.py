"""`start_hf_server`: a real `hf` engine server on loopback for tests and benchmarks (other packages' too).

The server runs in-process: the model and scheduler thread are built here, uvicorn serves on its
own event loop in a background thread, so a test can start one in ~1 s without a subprocess and
still talk to it over real HTTP. `stop()` shuts uvicorn down and joins both threads.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.engine.hf_server import HFServer, HFServerConfig


@dataclass
class ServerHandle:
    url: str
    server: HFServer
    _uvicorn: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)
        self.server.stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_hf_server(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    max_batch_size: int = 64,
    weight_version: int = 0,
    startup_timeout_s: float = 60.0,
    **options: Any,
) -> ServerHandle:
    """Start an `hf` server (extra `options` go to `HFServerConfig`); returns once it answers requests."""
    import uvicorn

    config = HFServerConfig(
        model_path=str(model_path),
        device=device,
        max_batch_size=max_batch_size,
        weight_version=weight_version,
        **options,
    )
    server = HFServer(config)
    server.start()
    port = port or free_port(host)
    uv = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, name=f"hf-server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            uv.should_exit = True
            server.stop()
            raise RuntimeError(f"hf server on {host}:{port} did not start within {startup_timeout_s}s (port taken?)")
        time.sleep(0.02)
    return ServerHandle(f"http://{host}:{port}", server, uv, thread)
