"""An `hf` server in a process of its own, for tests where this process is the trainer (rank 0 of a real group)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pipeline.net.addresses import free_port

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def hf_server_process(model: Path, log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `python -m pipeline.engine.server.hf.process` on a free port, wait until it is healthy, yield its URL;
    stop it (by pid) afterwards. A server that exits or stays unhealthy for 120 s fails with its log."""
    port = free_port()
    argv = [sys.executable, "-m", "pipeline.engine.server.hf.process", "--model-path", str(model), "--port", str(port),
            "--device", "cpu", "--seed", "0"]  # fmt: skip
    with open(log_path, "w") as log:
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not _healthy(url):
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, f"server not healthy: {log_path.read_text()[-3000:]}"
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
