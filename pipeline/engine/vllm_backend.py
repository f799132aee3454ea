"""The `vllm` backend: a real vLLM OpenAI server behind our SGLang-protocol adapter.

Processes of one server (see `servers.py`):
1. `python -m vllm.entrypoints.openai.api_server` from `inference.python` (vLLM needs its own venv:
   `scripts/vllm_venv.sh`), on an internal loopback port, with
   * `--return-tokens-as-token-ids`: completions carry `token_id:<n>` instead of token strings, so
     the adapter gets exact ids;
   * `--logprobs-mode processed_logprobs`: logprobs after temperature, like SGLang's default
     (vLLM's own default is the unscaled `raw_logprobs`; note vLLM's "processed" also applies
     top-k/top-p masks, SGLang's does not: with top-k/top-p off the two agree);
   * `--worker-extension-cls pipeline.engine.vllm_worker_ext.ArlWorkerExtension` and
     `VLLM_SERVER_DEV_MODE=1`: weight updates through `/collective_rpc` (disk reload, and a
     gloo/NCCL broadcast group);
2. `python -m pipeline.engine.vllm_adapter` (this interpreter) on the public port: the SGLang
   protocol in, token-in/token-out `/v1/completions` out. It is what gets registered.

`inference.extra_args` go to vLLM last, so they can override any flag above.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.engine.servers import REPO_ROOT, ProcSpec
from schemas.config import ArlConfig

WORKER_EXTENSION = "pipeline.engine.vllm_worker_ext.ArlWorkerExtension"
DEFAULT_CPU_KV_CACHE_GB = "2"  # vLLM's CPU default reserves far more; set VLLM_CPU_KVCACHE_SPACE to change


def vllm_procs(config: ArlConfig, *, host: str, port: int, model_path: str, version: int) -> list[ProcSpec]:
    """[vLLM server, adapter]: the adapter serves the SGLang protocol on `port`."""
    from pipeline.engine.testing import free_port

    internal = free_port("127.0.0.1")
    upstream = f"http://127.0.0.1:{internal}"
    tokenizer = config.model.tokenizer or model_path
    server = ProcSpec(
        vllm_command(config, model_path=model_path, tokenizer=tokenizer, port=internal),
        env=_vllm_env(),
        log_suffix="vllm",
        health_url=upstream,
    )
    adapter = ProcSpec(
        [
            sys.executable,
            "-m",
            "pipeline.engine.vllm_adapter",
            "--upstream",
            upstream,
            "--host",
            host,
            "--port",
            str(port),
            "--model-path",
            model_path,
            "--tokenizer-path",
            tokenizer,
            "--served-model-name",
            config.model.served_name,
            "--weight-version",
            str(version),
            "--max-context",
            str(config.model.max_context),
            "--tp-size",
            str(config.inference.tp_size),
        ],
        env=_pythonpath(),
    )
    return [server, adapter]


def vllm_command(config: ArlConfig, *, model_path: str, tokenizer: str, port: int) -> list[str]:
    """argv of the vLLM OpenAI server (loopback only: the adapter is its one client)."""
    inf = config.inference
    return [
        inf.python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--tokenizer",
        tokenizer,
        "--served-model-name",
        config.model.served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(inf.tp_size),
        "--gpu-memory-utilization",
        str(inf.mem_fraction),
        "--dtype",
        config.model.dtype,
        "--max-model-len",
        str(config.model.max_context),
        "--max-num-seqs",
        str(inf.max_batch_size),
        "--return-tokens-as-token-ids",
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        *inf.extra_args,
    ]


def _vllm_env() -> dict[str, str]:
    env = {"VLLM_SERVER_DEV_MODE": "1", **_pythonpath()}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KV_CACHE_GB))
    return env


def _pythonpath() -> dict[str, str]:
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{existing}" if existing else str(REPO_ROOT)}


def vllm_venv_python(root: Path = REPO_ROOT) -> Path | None:
    """`.vllm-venv/bin/python` when scripts/vllm_venv.sh has built it, else None."""
    python = root / ".vllm-venv" / "bin" / "python"
    return python if python.exists() else None
