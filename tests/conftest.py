"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2 checkpoint with the Qwen2.5 chat template, built once per session."""
    from pipeline.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), template="qwen")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (`make-tiny-model --arch qwen3`), its q/k norms drawn at random (they start as ones, which
    would let a swapped or dropped norm pass a comparison)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.demo.tiny_model import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", template="qwen3")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model with the Llama 3.1 chat template and special tokens, built once per session."""
    from pipeline.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), template="llama3")


@pytest.fixture
def make_train_run(tmp_path: Path, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """Factory: a run dir with a frozen config (tiny model, CPU trainer) and synthetic trajectory steps.

    `make_train_run(steps=[0, 1], overrides=[...], name="run")` writes config.yaml and, for each step,
    synthetic rows (rewarded and unrewarded completions per group) with real behaviour log-probs of
    the tiny model. Returns the run's `RunPaths`.
    """
    from pipeline.run.config import dump_config, load_config
    from pipeline.run.handoff import write_text_atomic
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import write_step
    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows
    from schemas.trajectory import rows_from_dicts

    def make(steps: list[int] = [0], overrides: list[str] = [], name: str = "run", **rows_kw):  # noqa: B006
        config = load_config(None, [f"fileroot={tmp_path}", "experiment_name=x", f"trial_name={name}",
                                    f"model.path={tiny_model_dir}", "trainer.device=cpu", *overrides])  # fmt: skip
        paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
        write_text_atomic(paths.config, dump_config(config))
        for step in steps:
            rows = add_behaviour_logprobs(synthetic_rows(step, **rows_kw), tiny_model_dir)
            write_step(paths, step, rows_from_dicts(rows), producer="rollout", tokenizer=str(tiny_model_dir))
        return paths

    return make


def _scripted_model(src: Path, dst: Path, chain: dict[str, str]) -> Path:
    """A copy of a tiny model whose next token is a fixed function of the current token (for proxy tests).

    The weights are constructed, not trained: every layer's output projections (attention o_proj, MLP
    down_proj) are zeroed, so the last hidden state is the current token's own embedding; the output
    layer is untied, and for each `source -> target` pair of `chain` the target's output row is set
    to a large multiple of the source's normalised hidden direction. Real forward passes through the
    real engine then emit a chosen continuation (e.g. a complete `<tool_call>` after a tool-choice
    prefill, then the end-of-turn token), which random weights never would.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = torch.nn.Parameter(emb.detach().clone() * 0.1)
        norm = model.model.norm
        targets: dict[int, torch.Tensor] = {}
        for source, target in chain.items():  # a target with several sources gets the sum of their directions
            (s,) = tok.encode(source, add_special_tokens=False)
            (t,) = tok.encode(target, add_special_tokens=False)
            h = norm(emb[s].unsqueeze(0))[0]
            targets[t] = targets.get(t, torch.zeros_like(h)) + 40.0 * h / h.norm()
        for t, row in targets.items():
            head[t] = row
        model.config.tie_word_embeddings = False
        model.lm_head.weight = head
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def scripted_qwen_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen-template model that answers `</tool_call><|im_end|>` after a generation prompt and completes a
    named Hermes tool-call prefill (`... "arguments": `) with `{}}\\n</tool_call><|im_end|>`."""
    chain = {" ": "{", "{": "}}", "}}": "\n", "\n": "</tool_call>", "</tool_call>": "<|im_end|>"}
    return _scripted_model(tiny_model_dir, tmp_path_factory.mktemp("scripted") / "qwen", chain)


@pytest.fixture(scope="session")
def scripted_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3-template model that ends a turn at once (`<|eot_id|>`) and completes a named llama3_json
    prefill (`... "parameters": `) with `{}}<|eot_id|>`."""
    chain = {" ": "{", "{": "}}", "}}": "<|eot_id|>", "\n\n": "<|eot_id|>"}
    return _scripted_model(tiny_llama_dir, tmp_path_factory.mktemp("scripted") / "llama3", chain)


@pytest.fixture(scope="session")
def hf_engine_url():  # type: ignore[no-untyped-def]
    """Factory: the URL of a real `hf` engine server for a model dir, started once per session and model."""
    from pipeline.engine.server.hf.process import start_hf_server

    handles: dict[str, object] = {}

    def url(model_dir: Path) -> str:
        key = str(model_dir)
        if key not in handles:
            handles[key] = start_hf_server(model_dir, max_batch_size=16)
        return handles[key].url  # type: ignore[attr-defined]

    yield url
    for handle in handles.values():
        handle.stop()  # type: ignore[attr-defined]


@pytest.fixture
async def start_proxy():  # type: ignore[no-untyped-def]
    """Factory: a real `ProxyServer` on a free loopback port in the test's event loop, stopped afterwards.

    `proxy = await start_proxy(model_dir, engine_url, admin_key="admin", **proxy_config_fields)`;
    returns the `ProxyServer` (its `.url` is set). `engine_url` may be any server of the engine protocol.
    """
    from pipeline.engine.client import EngineClient
    from pipeline.proxy.server import ProxyServer
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    started: list[tuple[ProxyServer, EngineClient]] = []

    async def start(model_dir: Path, engine_url: str, *, admin_key: str = "admin", model: dict | None = None,
                    **proxy_fields: object) -> ProxyServer:  # fmt: skip
        engine = EngineClient([engine_url], health_interval_s=0)
        proxy = ProxyServer(ModelConfig(path=str(model_dir), **(model or {})), ProxyConfig(**proxy_fields), engine,
                            admin_key=admin_key)  # fmt: skip
        await proxy.start()
        started.append((proxy, engine))
        return proxy

    yield start
    for proxy, engine in started:
        await proxy.stop()
        await engine.close()
