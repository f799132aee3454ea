"""HF <-> megatron weight conversion as pure functions: bit-exact round trips over TP/PP layouts, the
fused qkv / fc1 layouts themselves, vocab padding, and what `ModelDims` accepts or refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from pipeline.trainer.megatron.convert import Shard, hf_to_megatron, megatron_to_hf, stage_shard
from pipeline.trainer.megatron.model import ModelDims

LLAMA = {
    "model_type": "llama", "vocab_size": 515, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False,
    "max_position_embeddings": 256, "hidden_act": "silu",
}  # fmt: skip


def hf_state(model_type_cfg: dict) -> dict[str, torch.Tensor]:
    """A random-init HF model's state dict (real names and shapes, every value distinct)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_type_cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def round_trip(state: dict[str, torch.Tensor], dims: ModelDims, tp: int, pp: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards = [hf_to_megatron(state.__getitem__, dims, stage_shard(dims, r, tp, pp_rank, pp)) for r in range(tp)]
        out.update(megatron_to_hf(shards, dims, stage_shard(dims, 0, tp, pp_rank, pp)))
    return out


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 4)])
def test_llama_round_trip_is_bit_exact(tp: int, pp: int) -> None:
    state = hf_state(LLAMA)
    dims = ModelDims.from_hf_dict(LLAMA)
    assert dims.padded_vocab(tp) % tp == 0 and not dims.tied_embeddings and not dims.qkv_bias
    back = round_trip(state, dims, tp, pp)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_tiny_qwen_round_trip_is_bit_exact(tiny_model_dir: Path, tp: int, pp: int) -> None:
    from safetensors.torch import load_file

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    dims = ModelDims.from_hf(tiny_model_dir)
    assert dims.tied_embeddings and dims.qkv_bias and "lm_head.weight" not in state
    back = round_trip({**state, "lm_head.weight": state["model.embed_tokens.weight"]}, dims, tp, pp)
    assert torch.equal(back.pop("lm_head.weight"), state["model.embed_tokens.weight"])  # tied: HF state_dict has it
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_interleaved_per_kv_group_and_split_by_group_over_tp() -> None:
    dims = ModelDims.from_hf_dict({**LLAMA, "num_hidden_layers": 1})
    d, h = dims.head_dim, dims.hidden_size
    # Row i of q/k/v holds the head index (q: 0..7, k: 100+0..3, v: 200+0..3) so the layout is readable.
    q = torch.arange(dims.num_heads).repeat_interleave(d)[:, None].float().expand(-1, h)
    k = (100 + torch.arange(dims.num_kv_heads)).repeat_interleave(d)[:, None].float().expand(-1, h)
    v = (200 + torch.arange(dims.num_kv_heads)).repeat_interleave(d)[:, None].float().expand(-1, h)
    state = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
             "model.layers.0.self_attn.v_proj.weight": v}  # fmt: skip
    other = torch.zeros(1)

    def get(name: str) -> torch.Tensor:
        if name in state:
            return state[name]
        shapes = {"o_proj": (h, h), "gate_proj": (96, h), "up_proj": (96, h), "down_proj": (h, 96)}
        for key, shape in shapes.items():
            if key in name:
                return torch.zeros(shape)
        return other.expand(515, h) if "embed" in name or "lm_head" in name else torch.zeros(h)

    for tp, expected in [(1, [[0, 1, 100, 200, 2, 3, 101, 201, 4, 5, 102, 202, 6, 7, 103, 203]]),
                         (2, [[0, 1, 100, 200, 2, 3, 101, 201], [4, 5, 102, 202, 6, 7, 103, 203]])]:  # fmt: skip
        for r in range(tp):
            fused = hf_to_megatron(get, dims, Shard(tp_rank=r, tp=tp))[
                "decoder.layers.0.self_attention.linear_qkv.weight"
            ]
            heads = fused[::d, 0].long().tolist()
            assert heads == expected[r], (tp, r, heads)


def test_fc1_holds_gate_then_up_of_the_rank_slice() -> None:
    dims = ModelDims.from_hf_dict({**LLAMA, "num_hidden_layers": 1})
    state = hf_state({**LLAMA, "num_hidden_layers": 1})
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    fc1 = hf_to_megatron(state.__getitem__, dims, Shard(tp_rank=1, tp=2))["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))


def test_vocab_is_padded_with_zero_rows_to_a_multiple_of_tp() -> None:
    dims = ModelDims.from_hf_dict(LLAMA)
    state = hf_state(LLAMA)
    last = hf_to_megatron(state.__getitem__, dims, stage_shard(dims, 3, 4, 1, 2))
    emb = last["output_layer.weight"]
    assert dims.padded_vocab(4) == 516 and emb.shape[0] == 129
    assert torch.equal(emb[:128], state["lm_head.weight"][387:]) and not emb[128].any()


def test_stage_layers_and_what_each_stage_holds() -> None:
    dims = ModelDims.from_hf_dict(LLAMA)
    first, last = stage_shard(dims, 0, 1, 0, 2), stage_shard(dims, 0, 1, 1, 2)
    assert list(first.layers(dims)) == [0, 1] and list(last.layers(dims)) == [2, 3]
    state = hf_state(LLAMA)
    names_first = set(hf_to_megatron(state.__getitem__, dims, first))
    names_last = set(hf_to_megatron(state.__getitem__, dims, last))
    assert "embedding.word_embeddings.weight" in names_first and "output_layer.weight" not in names_first
    assert "output_layer.weight" in names_last and "decoder.final_layernorm.weight" in names_last
    assert (
        "decoder.layers.1.mlp.linear_fc1.weight" in names_last
        and "decoder.layers.2.mlp.linear_fc1.weight" not in names_last
    )


def test_num_params_equals_the_hf_model(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    for cfg, model in [(ModelDims.from_hf(tiny_model_dir), AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))),
                       (ModelDims.from_hf_dict(LLAMA), None)]:  # fmt: skip
        if model is None:
            from transformers import AutoConfig

            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_rope_theta_and_llama3_scaling_are_read_and_unknown_variants_refused() -> None:
    assert ModelDims.from_hf_dict(LLAMA).rope_theta == 500000.0
    assert ModelDims.from_hf_dict({**LLAMA, "rope_parameters": None, "rope_theta": 1e6}).rope_theta == 1e6
    scaled = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert ModelDims.from_hf_dict({**LLAMA, "rope_parameters": scaled}).rope_scaling_factor == 8.0
    with pytest.raises(ValueError, match="differs from megatron-core"):
        ModelDims.from_hf_dict({**LLAMA, "rope_parameters": {**scaled, "high_freq_factor": 2.0}})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelDims.from_hf_dict({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        ModelDims.from_hf_dict({**LLAMA, "model_type": "gemma"})
    with pytest.raises(ValueError, match="attention_bias"):
        ModelDims.from_hf_dict({**LLAMA, "attention_bias": True})
