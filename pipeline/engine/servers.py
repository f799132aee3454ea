"""Which processes make one inference server of each backend (one factory, chosen by `inference.backend`).

* `hf`: our engine, `python -m pipeline.engine.hf_server` (this interpreter);
* `sglang`: `python -m sglang.launch_server` (interpreter `inference.python`), speaks the protocol itself;
* `vllm`: vLLM's OpenAI server on an internal loopback port (interpreter `inference.python`), fronted
  by our adapter (`python -m pipeline.engine.vllm_adapter`) on the public port, which translates the
  SGLang protocol to token-in/token-out `/v1/completions` calls.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import ArlConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ProcSpec:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_suffix: str | None = None
    """None: the server's main log; else a second log file (`server-<i>-<suffix>...`)."""
    health_url: str | None = None
    """Where this process answers `/health` when it is not the protocol-serving one (e.g. vLLM behind the adapter)."""


def server_procs(config: ArlConfig, *, host: str, port: int, model_path: str, version: int) -> list[ProcSpec]:
    """The processes of one server, in start order; the last one serves the SGLang protocol on `port`."""
    backend = config.inference.backend
    if backend == "hf":
        return [_hf(config, host, port, model_path, version)]
    if backend == "sglang":
        from pipeline.engine.sglang_backend import SGLangArgs, sglang_command, sglang_dtype

        inf = config.inference
        args = SGLangArgs(
            model_path=model_path,
            host=host,
            port=port,
            tokenizer_path=config.model.tokenizer,
            tp_size=inf.tp_size,
            mem_fraction=inf.mem_fraction,
            dtype=sglang_dtype(config.model.dtype),
            context_length=config.model.max_context,
            weight_version=version,
            python=inf.python,
            extra_args=inf.extra_args,
        )
        return [ProcSpec(sglang_command(args), _pythonpath())]
    if backend == "vllm":
        from pipeline.engine.vllm_backend import vllm_procs

        return vllm_procs(config, host=host, port=port, model_path=model_path, version=version)
    raise ValueError(f"unknown inference.backend {backend!r}; use hf, vllm or sglang")


def _hf(config: ArlConfig, host: str, port: int, model_path: str, version: int) -> ProcSpec:
    inf = config.inference
    argv = [
        sys.executable,
        "-m",
        "pipeline.engine.hf_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        inf.device,
        "--dtype",
        config.model.dtype,
        "--max-batch-size",
        str(inf.max_batch_size),
        "--max-context",
        str(config.model.max_context),
        "--weight-version",
        str(version),
    ]
    if config.model.tokenizer:
        argv += ["--tokenizer-path", config.model.tokenizer]
    # Idle OpenMP workers sleep instead of spinning (see hf_server.main); a user's setting wins.
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **_pythonpath()}
    return ProcSpec(argv + list(inf.extra_args), env)


def _pythonpath() -> dict[str, str]:
    """Children import `pipeline` from this checkout even when it is not installed in their interpreter."""
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{existing}" if existing else str(REPO_ROOT)}
