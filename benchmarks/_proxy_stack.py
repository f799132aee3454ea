"""The processes of the proxy load harness: a real `hf` engine, a proxy, on loopback, stopped by pid.

Shared by `benchmarks/proxy_load.py` (which re-exports these names: tests load that script by
path as their harness) and the proxy tests. `start_proxy` runs this module as a script: its main
is `serve_proxy`, the proxy process (`ProxyServer` as the stages run it, plus `GET /_load/stats`).

    python benchmarks/_proxy_stack.py MODEL_DIR ENGINE_URL HOST PORT   # what start_proxy runs
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ADMIN_ENV = "ARL_LOAD_ADMIN_KEY"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180.0) -> None:
    """Wait until `url` answers 200; fail at once (with the reason) if `proc` exits first."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout_s}s") from None
            time.sleep(0.2)


@dataclass
class Stack:
    """The engine and proxy processes of one load run (stopped by pid in `close`)."""

    engine_url: str
    proxy_url: str
    admin_key: str
    engine: subprocess.Popen[bytes]
    proxy: subprocess.Popen[bytes]
    proxy_log: Path

    def close(self) -> None:
        for proc in (self.proxy, self.engine):
            if proc.poll() is None:
                proc.terminate()
        for proc in (self.proxy, self.engine):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


ENGINE_WITH_KEEP_ALIVE = """
import sys
from pipeline.engine.server.hf.process import serve_hf
from pipeline.engine.server.hf.engine import HFEngineConfig
model, port, keep_alive = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
serve_hf(HFEngineConfig(model_path=model, device="cpu", max_batch_size=64), host="127.0.0.1", port=port,
         timeout_keep_alive=keep_alive)
"""


def start_engine(model_dir: str | Path, log_path: Path, *, port: int | None = None,
                 keep_alive_s: float | None = None) -> tuple[str, subprocess.Popen[bytes]]:  # fmt: skip
    """A real `hf` server subprocess on loopback; returns (url, process) once it answers /health.

    `keep_alive_s` serves the same `hf` app with another HTTP keep-alive than uvicorn's 5 s
    (see `test_a_request_after_the_servers_keep_alive_expired_is_not_lost` for why that matters).
    """
    port = port or free_port()
    log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it for its lifetime
    if keep_alive_s is None:
        argv = [sys.executable, "-m", "pipeline.engine.server.hf.process", "--model-path", str(model_dir),
                "--port", str(port), "--device", "cpu", "--max-batch-size", "64"]  # fmt: skip
    else:
        argv = [sys.executable, "-c", ENGINE_WITH_KEEP_ALIVE, str(model_dir), str(port), str(keep_alive_s)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return url, proc


def start_proxy(model_dir: str | Path, engine_url: str, log_path: Path, *, admin_key: str,
                client_keys: list[str] | None = None, host: str = "127.0.0.1",
                log_level: str = "INFO") -> tuple[str, subprocess.Popen[bytes]]:  # fmt: skip
    """The proxy as its own process (`serve_proxy`, this module's main); keys travel in the environment, never argv."""
    port = free_port()
    env = {**os.environ, ADMIN_ENV: admin_key, "ARL_LOAD_CLIENT_KEYS": json.dumps(client_keys or []),
           "ARL_LOG_LEVEL": log_level}  # fmt: skip
    log = open(log_path, "ab")  # noqa: SIM115
    argv = [sys.executable, str(Path(__file__).resolve()), str(model_dir), engine_url, host, str(port)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{host}:{port}"
    wait_http(url + "/health", proc)
    return url, proc


def start_stack(model_dir: str | Path, workdir: Path, *, log_level: str = "INFO",
                engine_keep_alive_s: float | None = None) -> Stack:  # fmt: skip
    admin = "arl-admin-" + secrets.token_urlsafe(16)
    engine_url, engine = start_engine(model_dir, workdir / "engine.log", keep_alive_s=engine_keep_alive_s)
    try:
        proxy_url, proxy = start_proxy(model_dir, engine_url, workdir / "proxy.log", admin_key=admin,
                                       log_level=log_level)  # fmt: skip
    except BaseException:
        engine.kill()
        engine.wait()
        raise
    return Stack(engine_url, proxy_url, admin, engine, proxy, workdir / "proxy.log")


def serve_proxy(model_dir: str, engine_url: str, host: str, port: int) -> None:
    """The proxy process: `ProxyServer` plus `GET /_load/stats` (admin key) for leak checks."""
    import gc

    from fastapi import Depends
    from starlette.responses import JSONResponse

    from pipeline.engine.client import EngineClient
    from pipeline.proxy.auth import caller_of
    from pipeline.proxy.server import ProxyServer
    from pipeline.run.logs import setup_logging
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    setup_logging("proxy")
    admin = os.environ[ADMIN_ENV]
    clients = json.loads(os.environ.get("ARL_LOAD_CLIENT_KEYS", "[]"))

    async def main() -> None:
        engine = EngineClient([engine_url], health_interval_s=0)
        extra = json.loads(os.environ.get("ARL_LOAD_PROXY_CONFIG", "{}"))  # e.g. a small max_tokens_limit for fuzzing
        # history: sampled. The engine here samples random tokens (special tokens, spacing the template would not
        # write back), which under the default `template` would split a few sessions' rows; what the harness
        # checks is that no session loses or mixes up a call under load, one row per unedited session.
        base = {"host": host, "port": port, "max_sessions": 100_000, "client_keys": clients, "history": "sampled"}
        config = ProxyConfig(**{**base, **extra})
        proxy = ProxyServer(ModelConfig(path=model_dir), config, engine, admin_key=admin)

        proxy.protect("/_load/stats", "admin")

        @proxy.app.get("/_load/stats")
        async def stats(caller: Any = Depends(caller_of)) -> Any:
            gc.collect()
            # frozen objects count too: the proxy freezes its start-up heap (server.freeze_startup_heap)
            objects = len(gc.get_objects()) + gc.get_freeze_count()
            return JSONResponse({"sessions": len(proxy.store.sessions), "open": proxy.store.open_count(),
                                 "objects": objects, "engine_inflight": engine.inflight()})  # fmt: skip

        await proxy.start()
        await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    serve_proxy(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
