"""Command lines of each backend's server processes (SGLang cannot be installed here: its argv is the contract)."""

from __future__ import annotations

import sys

import pytest

from pipeline.engine.inference.procs import server_procs, vllm_lora_rank
from pipeline.run.config import load_config


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_sglang_command_from_config():
    config = load_config(
        None,
        [
            "inference.backend=sglang",
            "inference.tp_size=4",
            "inference.mem_fraction=0.7",
            "inference.python=/opt/sgl/bin/python",
            "model.dtype=bfloat16",
            "model.max_context=8192",
            "model.tokenizer=/tok",
            "inference.extra_args=[--enable-metrics, --tp-size, '8']",
        ],
    )
    (proc,) = server_procs(config, host="0.0.0.0", port=30001, model_path="/ckpt/step_000003", version=3)
    argv = proc.argv
    assert argv[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/ckpt/step_000003" and flag(argv, "--tokenizer-path") == "/tok"
    assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "30001"
    assert flag(argv, "--tp-size") == "4" and flag(argv, "--mem-fraction-static") == "0.7"
    assert flag(argv, "--dtype") == "bfloat16" and flag(argv, "--context-length") == "8192"
    assert flag(argv, "--weight-version") == "3"
    assert argv[-3:] == ["--enable-metrics", "--tp-size", "8"]  # extra args last: they win


def test_sglang_defaults_to_this_interpreter_and_the_model_tokenizer():
    config = load_config(None, ["inference.backend=sglang"])
    (proc,) = server_procs(config, host="127.0.0.1", port=1, model_path="/m", version=0)
    assert proc.argv[0] == sys.executable and flag(proc.argv, "--tokenizer-path") == "/m"
    assert "pipeline" not in proc.argv  # no adapter: SGLang speaks the protocol itself


def test_hf_command_from_config():
    config = load_config(None, ["inference.device=cpu", "inference.max_batch_size=8", "model.max_context=512"])
    (proc,) = server_procs(config, host="127.0.0.1", port=4000, model_path="/m", version=2)
    argv = proc.argv
    assert argv[:3] == [sys.executable, "-m", "pipeline.engine.server.hf.process"]
    assert flag(argv, "--device") == "cpu" and flag(argv, "--max-batch-size") == "8"
    assert flag(argv, "--max-context") == "512" and flag(argv, "--weight-version") == "2"
    assert "PYTHONPATH" in proc.env


def test_vllm_server_and_adapter_commands():
    config = load_config(
        None,
        [
            "inference.backend=vllm",
            "inference.python=/v/bin/python",
            "inference.tp_size=2",
            "model.max_context=4096",
            "inference.extra_args=[--enforce-eager]",
        ],
    )
    server, adapter = server_procs(config, host="0.0.0.0", port=30002, model_path="/ckpt", version=7)
    argv = server.argv
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "/ckpt" and flag(argv, "--host") == "127.0.0.1"  # only the adapter is public
    assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--max-model-len") == "4096"
    assert "--return-tokens-as-token-ids" in argv and flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--worker-extension-cls") == "pipeline.engine.server.vllm.worker_ext.ArlWorkerExtension"
    assert argv[-1] == "--enforce-eager" and server.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert adapter.argv[:3] == [sys.executable, "-m", "pipeline.engine.server.vllm.adapter"]
    assert flag(adapter.argv, "--port") == "30002" and flag(adapter.argv, "--host") == "0.0.0.0"
    assert flag(adapter.argv, "--upstream") == server.health_url == f"http://127.0.0.1:{flag(argv, '--port')}"
    assert flag(adapter.argv, "--weight-version") == "7" and flag(adapter.argv, "--tp-size") == "2"


def _publishing_adapters(backend: str, rank: int, targets: object = "all-linear") -> list[object]:
    from schemas.config import LoraConfig

    config = load_config(None, [f"inference.backend={backend}", "inference.extra_args=[--x]"])
    lora = LoraConfig.model_construct(rank=rank, target_modules=targets, publish="adapter")
    object.__setattr__(config.trainer, "lora", lora)  # past validation (the schema may refuse `adapter`)
    return server_procs(config, host="127.0.0.1", port=30001, model_path="/m", version=0)


def test_lora_flags_only_when_the_run_publishes_adapters():
    """vLLM: rank rounded up to one it accepts, 2 adapters a batch, runtime loading on; SGLang: rank, targets, and
    3 slots (the base takes one). Without `publish: adapter` neither gets a LoRA flag. (The engines' own parsers
    judge these in test_vllm_contract.py / test_sglang_contract.py.)"""
    vllm, _adapter = _publishing_adapters("vllm", 12)
    assert vllm.argv[-6:] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--x"]  # extra args last
    assert vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    (sglang,) = _publishing_adapters("sglang", 12, ["q_proj", "v_proj"])
    assert sglang.argv[-11:] == ["--enable-lora", "--max-lora-rank", "12", "--lora-target-modules", "q_proj", "v_proj",
                                 "--max-loras-per-batch", "3", "--max-loaded-loras", "3", "--x"]  # fmt: skip
    (sglang,) = _publishing_adapters("sglang", 16)
    assert flag(sglang.argv, "--lora-target-modules") == "all"
    with pytest.raises(ValueError, match="largest --max-lora-rank 512"):
        vllm_lora_rank(513)
    plain = load_config(None, ["inference.backend=vllm"])
    vllm, _adapter = server_procs(plain, host="127.0.0.1", port=30001, model_path="/m", version=0)
    assert "--enable-lora" not in vllm.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm.env
