"""The processes of one inference server of each backend (one factory, chosen by `inference.backend`).

* `hf`: our engine, `python -m pipeline.engine.server.hf.process` (this interpreter);
* `sglang`: `python -m sglang.launch_server` (interpreter `inference.python`), which speaks the
  protocol itself (docs/inference.md), so there is no adapter;
* `vllm`: vLLM's OpenAI server on an internal loopback port (interpreter `inference.python`; vLLM
  needs its own venv, `scripts/vllm_venv.sh`), fronted by our adapter
  (`python -m pipeline.engine.server.vllm.adapter`) on the public port.

`inference.extra_args` go last on the engine's command line (vLLM's, not the adapter's), so they can
override any flag set here.

A run that publishes LoRA adapters (`trainer.lora.publish: adapter`) starts vLLM and SGLang with their LoRA
flags (`lora_flags`): adapters loaded at run time by `/load_lora_adapter`, up to `trainer.lora.rank`, and room
for `LORA_ADAPTERS` of them at once (the current version and the previous one, whose requests may still run).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.net.addresses import free_port
from schemas.config import ArlConfig, LoraConfig

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER_EXTENSION = "pipeline.engine.server.vllm.worker_ext.ArlWorkerExtension"
DEFAULT_CPU_KV_CACHE_GB = "2"  # vLLM's CPU default reserves far more; set VLLM_CPU_KVCACHE_SPACE to change
LORA_ADAPTERS = 2
"""Adapters a server holds at once in a run that publishes them: the current version and the previous one."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's `--max-lora-rank` accepts (`vllm.config.lora.MaxLoRARanks`)."""


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
        return [ProcSpec(hf_command(config, host, port, model_path, version), _hf_env())]
    if backend == "sglang":
        return [ProcSpec(sglang_command(config, host, port, model_path, version), _pythonpath())]
    if backend == "vllm":
        return vllm_procs(config, host=host, port=port, model_path=model_path, version=version)
    raise ValueError(f"unknown inference.backend {backend!r}; use hf, vllm or sglang")


def hf_command(config: ArlConfig, host: str, port: int, model_path: str, version: int) -> list[str]:
    inf = config.inference
    argv = [
        sys.executable,
        "-m",
        "pipeline.engine.server.hf.process",
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
        # A trainer that dies or stalls mid-broadcast ends the receive within its own broadcast deadline.
        "--weight-group-timeout-s",
        str(config.trainer.broadcast_timeout_s),
        "--prefix-cache-mb",
        str(inf.prefix_cache_mb),
    ]
    if config.model.tokenizer:
        argv += ["--tokenizer-path", config.model.tokenizer]
    return argv + list(inf.extra_args)


def _hf_env() -> dict[str, str]:
    # Idle OpenMP workers sleep instead of spinning (see hf.main); a user's setting wins.
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **_pythonpath()}


def sglang_command(config: ArlConfig, host: str, port: int, model_path: str, version: int) -> list[str]:
    """A real SGLang server; flags are SGLang's `ServerArgs`. `--weight-version` makes
    `meta_info.weight_version` arl's version from the first request on (without it SGLang says "default")."""
    inf = config.inference
    return [
        inf.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--tokenizer-path",
        config.model.tokenizer or model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(inf.tp_size),
        "--mem-fraction-static",
        str(inf.mem_fraction),
        "--dtype",
        sglang_dtype(config.model.dtype),
        "--weight-version",
        str(version),
        "--context-length",
        str(config.model.max_context),
        *lora_flags(config, "sglang"),
        *inf.extra_args,
    ]


def sglang_dtype(dtype: str) -> str:
    """arl's `model.dtype` as SGLang's `--dtype` value (the same names)."""
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")


def vllm_procs(config: ArlConfig, *, host: str, port: int, model_path: str, version: int) -> list[ProcSpec]:
    """[vLLM server, adapter]: the adapter serves the SGLang protocol on `port`, vLLM on a loopback port."""
    internal = free_port("127.0.0.1")
    upstream = f"http://127.0.0.1:{internal}"
    tokenizer = config.model.tokenizer or model_path
    server = ProcSpec(
        vllm_command(config, model_path=model_path, tokenizer=tokenizer, port=internal),
        env=_vllm_env(config),
        log_suffix="vllm",
        health_url=upstream,
    )
    adapter_argv = [
        sys.executable,
        "-m",
        "pipeline.engine.server.vllm.adapter",
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
    ]
    return [server, ProcSpec(adapter_argv, env=_pythonpath())]


def vllm_command(config: ArlConfig, *, model_path: str, tokenizer: str, port: int) -> list[str]:
    """argv of the vLLM OpenAI server (loopback only: the adapter is its one client).

    * `--return-tokens-as-token-ids`: completions carry `token_id:<n>`, so the adapter gets exact ids;
    * `--logprobs-mode processed_logprobs`: logprobs after temperature, like SGLang's default (vLLM's
      own default is the unscaled `raw_logprobs`; vLLM's "processed" also applies top-k/top-p masks,
      SGLang's does not: with top-k/top-p off the two agree);
    * `--worker-extension-cls` (with `VLLM_SERVER_DEV_MODE=1`): weight updates through `/collective_rpc`.
    """
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
        *lora_flags(config, "vllm"),
        *inf.extra_args,
    ]


def published_adapter(config: ArlConfig) -> LoraConfig | None:
    """`trainer.lora` when the run publishes LoRA adapters to the servers (`publish: adapter`), else None."""
    return config.trainer.lora if config.trainer.publishes_adapters else None


def lora_flags(config: ArlConfig, backend: str) -> list[str]:
    """The engine's LoRA flags in a run that publishes adapters (none otherwise).

    * vLLM: `--max-loras` adapters in a batch (the base model takes no slot), `--max-lora-rank` rounded up to a
      value vLLM accepts; loading at run time also needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`_vllm_env`).
    * SGLang: the base model takes one of `--max-loras-per-batch`'s slots, and SGLang requires
      `--max-loaded-loras` >= it; without adapters at start it needs `--max-lora-rank` and `--lora-target-modules`
      (`all`, resolved from the model, for PEFT's `all-linear`).
    """
    lora = published_adapter(config)
    if lora is None:
        return []
    if backend == "vllm":
        return ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora.rank)), "--max-loras", str(LORA_ADAPTERS)]
    targets = ["all"] if lora.target_modules == "all-linear" else list(lora.target_modules)
    slots = str(LORA_ADAPTERS + 1)
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *targets,
        "--max-loras-per-batch",
        slots,
        "--max-loaded-loras",
        slots,
    ]


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"trainer.lora.rank={rank} is above vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")


def _vllm_env(config: ArlConfig) -> dict[str, str]:
    env = {"VLLM_SERVER_DEV_MODE": "1", **_pythonpath()}
    if published_adapter(config) is not None:  # vLLM serves /v1/load_lora_adapter only with it
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KV_CACHE_GB))
    return env


def _pythonpath() -> dict[str, str]:
    """Children import `pipeline` from this checkout even when it is not installed in their interpreter."""
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{existing}" if existing else str(REPO_ROOT)}


def vllm_venv_python(root: Path = REPO_ROOT) -> Path | None:
    """`.vllm-venv/bin/python` when scripts/vllm_venv.sh has built it, else None."""
    python = root / ".vllm-venv" / "bin" / "python"
    return python if python.exists() else None
