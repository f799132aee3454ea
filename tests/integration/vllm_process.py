"""A `vllm` server for tests: vLLM's OpenAI server (the CPU build in `.vllm-venv`) and arl's adapter in front
of it, started by `procs.vllm_procs` as the inference stage starts them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from pipeline.engine.inference.procs import ProcSpec, vllm_procs, vllm_venv_python
from pipeline.net.addresses import free_port
from pipeline.run.config import load_config
from schemas.config import ArlConfig, LoraConfig


@dataclass(frozen=True)
class VLLMServer:
    url: str
    """The adapter: SGLang's protocol."""
    upstream: str
    """vLLM's own server behind it (loopback)."""


@contextlib.contextmanager
def vllm_server(
    model_dir: Path, logs: Path, *overrides: str, max_context: int = 512, lora: LoraConfig | None = None
) -> Iterator[VLLMServer]:
    """Start vLLM and the adapter, wait until both are healthy, yield their URLs; stop them (by pid) after.

    `--enforce-eager`: torch.compile's warm-up takes minutes on a busy CPU. `overrides` are arl config ones;
    `lora`: the run's `trainer.lora` (with `publish: adapter`, vLLM starts with its LoRA flags)."""
    port = free_port()
    config = load_config(None, [f"model.path={model_dir}", "inference.backend=vllm", f"model.max_context={max_context}",
                                f"inference.python={vllm_venv_python()}", "inference.max_batch_size=16",
                                "inference.extra_args=[--enforce-eager]", *overrides])  # fmt: skip
    if lora is not None:
        with_lora(config, lora)
    specs = vllm_procs(config, host="127.0.0.1", port=port, model_path=str(model_dir), version=0)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, spec in enumerate(specs):  # all at once, as the inference stage starts them (servers.py)
            procs.append(_start(spec, logs / f"proc{i}.log"))
        for i, (proc, spec) in enumerate(zip(procs, specs, strict=True)):
            _wait_healthy(proc, spec.health_url or f"http://127.0.0.1:{port}", logs / f"proc{i}.log")
        yield VLLMServer(f"http://127.0.0.1:{port}", str(specs[0].health_url))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serving(server: VLLMServer, model_dir: Path) -> VLLMServer:
    """`server` (shared by several modules) serving `model_dir`'s weights as version 0 again, unpaused, as if
    just started: earlier tests swapped its weights and moved its version."""
    reloaded = httpx.post(server.url + "/update_weights_from_disk",
                          json={"model_path": str(model_dir), "weight_version": "0"}, timeout=300)  # fmt: skip
    assert reloaded.status_code == 200, reloaded.text
    info = httpx.get(server.url + "/server_info", timeout=60).json()
    assert (info["weight_version"], info["paused"], info["running"]) == ("0", False, 0), info
    return server


def with_lora(config: ArlConfig, lora: LoraConfig) -> ArlConfig:
    """`config` with `trainer.lora` set to `lora`, as given: not validated again, so a `LoraConfig` built with
    `model_construct` (`publish: adapter` while the schema refuses it) stays as it is."""
    object.__setattr__(config.trainer, "lora", lora)
    return config


def _start(spec: ProcSpec, log: Path) -> subprocess.Popen[bytes]:
    handle = open(log, "wb")  # noqa: SIM115 - owned by the child
    return subprocess.Popen(spec.argv, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **spec.env})


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"not healthy after {timeout_s}s:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
