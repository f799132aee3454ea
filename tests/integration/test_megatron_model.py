"""The megatron model and backend in one process (world size 1, gloo, the CUDA shim) against Hugging Face
and the torch backend: logits, packed rows, HF round trip through a real GPTModel, one training step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from pipeline.trainer.losses import LossOutput, TokenBatch, policy_loss
from pipeline.trainer.packing import MicroBatch

LLAMA_CFG = dict(vocab_size=515, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 max_position_embeddings=256,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip


@pytest.fixture(scope="module")
def tiny_untied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Llama (untied embeddings, no qkv bias, odd vocab, theta 5e5) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_untied_llama")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**LLAMA_CFG)).save_pretrained(str(out))
    return out


def _model_dir(which: str, request: pytest.FixtureRequest) -> Path:
    fixture = {"qwen": "tiny_model_dir", "llama": "tiny_untied_llama", "qwen3": "tiny_qwen3_dir"}[which]
    return Path(request.getfixturevalue(fixture))


@pytest.fixture
def single_rank() -> Iterator[None]:
    """megatron's process groups for one process; torn down (shim removed) afterwards."""
    from pipeline.trainer.megatron import parallel

    parallel.init(1, 1, "cpu", seed=0)
    yield
    parallel.destroy()


def megatron_model(model_dir: Path) -> torch.nn.Module:
    from pipeline.trainer.megatron.model import ModelDims, RunSettings, build_model, transformer_config
    from pipeline.trainer.megatron.parallel import Topology
    from pipeline.trainer.megatron.transfer import load_hf_into

    dims = ModelDims.from_hf(model_dir)
    model = build_model(dims, transformer_config(dims, RunSettings()), pre_process=True, post_process=True)
    topo = Topology(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"))
    load_hf_into(model, model_dir, dims, topo)
    return model.eval()


def packed_row(lengths: list[int], vocab: int, seed: int = 0) -> tuple[MicroBatch, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    total = sum(lengths)
    zero = torch.zeros(total)
    micro = MicroBatch(torch.cat(samples)[None], torch.cat([torch.arange(n) for n in lengths])[None],
                       torch.zeros(total, dtype=torch.long), TokenBatch(zero, zero, zero, zero),
                       list(range(len(lengths))), lengths)  # fmt: skip
    return micro, samples


@pytest.mark.parametrize("which", ["qwen", "llama", "qwen3"])
def test_logits_equal_hf_for_single_and_packed_samples(
    which: str, request: pytest.FixtureRequest, single_rank: None
) -> None:
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.megatron.forward import pack_inputs, run_stage

    model_dir = _model_dir(which, request)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = megatron_model(model_dir)
    micro, samples = packed_row([9, 17, 6], vocab=hf.config.vocab_size)
    with torch.no_grad():
        alone = [hf(input_ids=s[None], use_cache=False).logits[0] for s in samples]
        packed = run_stage(model, pack_inputs(micro, torch.device("cpu")), None)
        singles = [run_stage(model, pack_inputs(_single(s), torch.device("cpu")), None) for s in samples]
    assert packed.shape == (32, hf.config.vocab_size)
    for mine, ref in zip(singles, alone, strict=True):
        assert (mine - ref).abs().max().item() < 1e-4
    # The packed row: every sample sees only itself (block-diagonal attention, rope restarting per sample).
    assert (packed - torch.cat(alone)).abs().max().item() < 1e-4


def _single(ids: torch.Tensor) -> MicroBatch:
    n = len(ids)
    zero = torch.zeros(n)
    return MicroBatch(ids[None], torch.arange(n)[None], torch.zeros(n, dtype=torch.long),
                      TokenBatch(zero, zero, zero, zero), [0], [n])  # fmt: skip


@pytest.mark.parametrize("which", ["qwen", "llama", "qwen3"])
def test_hf_to_megatron_model_to_hf_is_bit_exact(which: str, request: pytest.FixtureRequest, single_rank: None) -> None:
    from safetensors.torch import load_file

    from pipeline.trainer.megatron.model import ModelDims
    from pipeline.trainer.megatron.parallel import Topology
    from pipeline.trainer.megatron.transfer import gather_hf

    model_dir = _model_dir(which, request)
    model = megatron_model(model_dir)
    dims = ModelDims.from_hf(model_dir)
    exported = gather_hf(model, dims, Topology(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu")), torch.float32)
    original = load_file(str(model_dir / "model.safetensors"))
    if dims.tied_embeddings:
        assert torch.equal(exported.pop("lm_head.weight"), original["model.embed_tokens.weight"])
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def decoupled_loss(algo):  # type: ignore[no-untyped-def]
    """The loop's loss_fn with one minibatch: proximal log-probs = the detached current ones."""

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor | None, batch: TokenBatch) -> LossOutput:
        return policy_loss(logp, entropy, dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask), algo)

    return loss_fn


def test_one_training_step_equals_the_torch_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same micro-batches, same shared loss: log-probs, loss, grad norm, every gradient and the updated weights."""
    from pipeline.run.config import load_config
    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.data import rows_to_samples
    from pipeline.trainer.megatron.convert import Shard, megatron_to_hf
    from pipeline.trainer.megatron.megatron_backend import MegatronBackend
    from pipeline.trainer.packing import plan_step
    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows
    from pipeline.trainer.torch_backend import TorchBackend

    config = load_config(None, [f"fileroot={tmp_path}", "experiment_name=x", "trial_name=y",
                                f"model.path={tiny_model_dir}", "trainer.device=cpu", "trainer.optimizer.lr=0.01",
                                "trainer.algorithm.entropy_coef=0.01", "trainer.optimizer.eps=0.001"])  # fmt: skip
    samples = rows_to_samples(add_behaviour_logprobs(synthetic_rows(0, completion_lens=[5, 9, 13]), tiny_model_dir))
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples],
                             config.trainer.algorithm.advantage)  # fmt: skip
    plan = plan_step(samples, adv, minibatches=1, budget=48, agg="token", seed=0, step=0)
    assert len(plan[0]) >= 2  # several packed rows, several samples per row
    results = {}
    for name, cls in [("torch", TorchBackend), ("megatron", MegatronBackend)]:
        backend = cls(config, total_updates=4)
        try:
            backend.load(tiny_model_dir, None)
            logp = [backend.logprobs(m) for m in plan[0]]
            stats = backend.train_minibatch(plan[0], decoupled_loss(config.trainer.algorithm))
            grads = {k: p.grad.clone() for k, p in backend.model.named_parameters()}
            if name == "megatron":
                grads = megatron_to_hf([grads], backend.dims, Shard())
            results[name] = (logp, stats, grads, backend.hf_state_dict())
        finally:
            backend.close()
    (lp_t, st_t, g_t, w_t), (lp_m, st_m, g_m, w_m) = results["torch"], results["megatron"]
    for a, b in zip(lp_t, lp_m, strict=True):
        assert (a - b).abs().max().item() < 1e-5
    assert st_m.loss == pytest.approx(st_t.loss, abs=1e-6)
    assert st_m.grad_norm == pytest.approx(st_t.grad_norm, rel=1e-5)
    assert st_m.tokens == st_t.tokens and st_m.lr == st_t.lr
    assert set(st_m.sums) == set(st_t.sums)
    for key, value in st_t.sums.items():
        assert st_m.sums[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for key, grad in g_t.items():
        if key == "lm_head.weight":  # tied: HF's lm_head IS the embedding
            continue
        scale = grad.abs().max().item()
        assert (g_m[key] - grad).abs().max().item() <= 1e-4 * scale + 1e-9, key
    # Adam's first update is lr * g / (|g| + eps): with the default eps=1e-8, float noise of 1e-9 in a
    # near-zero gradient (embedding rows of unused tokens) moves that element's update by up to ~lr/4;
    # eps=1e-3 removes that amplification, so the updated weights agree to float precision.
    for key, weight in w_t.items():
        assert (w_m[key] - weight).abs().max().item() < 1e-6, key
