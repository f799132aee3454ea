"""Hugging Face <-> megatron-core weight conversion, sharded for tensor and pipeline parallelism.

Pure functions on name -> tensor mappings, so they are tested without any process group:
`hf_to_megatron` gives ONE rank's parameters (its TP slice of its pipeline stage's layers) under
megatron's local names; `megatron_to_hf` merges the TP slices of one stage back into HF-named full
tensors. The backend gathers each rank's slices (`backend.py`) and calls the latter, for checkpoints
and for weight publication alike, so inference servers only ever see HF names.

Layouts (megatron-core 0.16 local spec, HF Qwen2/Qwen3/Llama):
- `linear_qkv` (column parallel): rows grouped per KV head g as [q heads of g | k_g | v_g], each
  head `head_dim` rows; TP rank r holds the contiguous groups [r*G/tp, (r+1)*G/tp). Same for the
  Qwen2 qkv bias. (HF query head i belongs to group i // (heads / kv_heads), as in GQA.)
- `linear_fc1` (column parallel, SwiGLU): TP rank r holds [gate_r ; up_r] (its row slice of each),
  because megatron's glu splits ITS LOCAL output in two halves: gate first.
- `linear_proj`, `linear_fc2` (row parallel): column slices.
- embedding / output layer (vocab parallel): row slices of the vocab padded to a multiple of tp.
- norms: replicated on every TP rank (Qwen3's per-head `q_norm`/`k_norm` are megatron's `q_layernorm`/`k_layernorm`).
- pipeline stage s holds layers [offset, offset + n) under local indices 0..n-1; the embedding lives
  on the first stage, final norm and output layer on the last (with tied embeddings and pp > 1 the
  last stage keeps its own copy of the embedding as output layer, kept equal by megatron's
  embedding group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeline.trainer.megatron.model import ModelDims


@dataclass(frozen=True)
class Shard:
    """The piece of the model one rank holds."""

    tp_rank: int = 0
    tp: int = 1
    first_layer: int = 0
    num_layers: int | None = None
    """Layers of this pipeline stage (None = all of them, i.e. pp == 1)."""
    pre_process: bool = True
    """First pipeline stage (holds the embedding)."""
    post_process: bool = True
    """Last pipeline stage (final norm and output layer)."""

    def layers(self, dims: ModelDims) -> range:
        n = dims.num_layers if self.num_layers is None else self.num_layers
        return range(self.first_layer, self.first_layer + n)


def stage_shard(dims: ModelDims, tp_rank: int, tp: int, pp_rank: int, pp: int) -> Shard:
    """The shard of (tp_rank, pp_rank) with layers split evenly over pp stages (as megatron does)."""
    per_stage = dims.num_layers // pp
    return Shard(tp_rank, tp, pp_rank * per_stage, per_stage, pp_rank == 0, pp_rank == pp - 1)


# -- HF -> megatron (load) ---------------------------------------------------------------------------
QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))
"""Qwen3's per-head query/key RMSNorms: (HF name, megatron name) under the attention module."""


def hf_to_megatron(get: Callable[[str], torch.Tensor], dims: ModelDims, shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's parameters under megatron names; `get(hf_name)` reads one HF tensor (e.g. lazily from disk)."""
    r, tp = shard.tp_rank, shard.tp
    out: dict[str, torch.Tensor] = {}
    if shard.pre_process:
        out["embedding.word_embeddings.weight"] = _vocab_slice(get("model.embed_tokens.weight"), dims, r, tp)
    for local, layer in enumerate(shard.layers(dims)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out[mg + "input_layernorm.weight"] = get(hf + "input_layernorm.weight").clone()
        attn = hf + "self_attn."
        out[mg + "self_attention.linear_qkv.weight"] = _qkv_slice(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), dims, r, tp
        )
        if dims.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = _qkv_slice(
                get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), dims, r, tp
            )
        out[mg + "self_attention.linear_proj.weight"] = get(attn + "o_proj.weight").chunk(tp, dim=1)[r].clone()
        for norm in QK_NORMS if dims.qk_norm else ():  # per head over head_dim: replicated on every TP rank
            out[mg + f"self_attention.{norm[1]}.weight"] = get(attn + f"{norm[0]}.weight").clone()
        out[mg + "pre_mlp_layernorm.weight"] = get(hf + "post_attention_layernorm.weight").clone()
        gate = get(hf + "mlp.gate_proj.weight").chunk(tp, dim=0)[r]
        up = get(hf + "mlp.up_proj.weight").chunk(tp, dim=0)[r]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = get(hf + "mlp.down_proj.weight").chunk(tp, dim=1)[r].clone()
    if shard.post_process:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight").clone()
        if not dims.tied_embeddings:
            out["output_layer.weight"] = _vocab_slice(get("lm_head.weight"), dims, r, tp)
        elif not shard.pre_process:
            out["output_layer.weight"] = _vocab_slice(get("model.embed_tokens.weight"), dims, r, tp)
    return out


def _vocab_slice(weight: torch.Tensor, dims: ModelDims, r: int, tp: int) -> torch.Tensor:
    padded = dims.padded_vocab(tp)
    if weight.shape[0] != dims.vocab_size:
        raise ValueError(f"vocab tensor has {weight.shape[0]} rows, config.json says vocab_size={dims.vocab_size}")
    if padded > dims.vocab_size:
        weight = torch.cat([weight, weight.new_zeros(padded - dims.vocab_size, weight.shape[1])], dim=0)
    return weight.chunk(tp, dim=0)[r].clone()


def _qkv_slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: ModelDims, r: int, tp: int) -> torch.Tensor:
    """[q | k | v] interleaved per KV group (see module docstring), rank r's groups only."""
    groups, per_group, d = dims.num_kv_heads, dims.num_heads // dims.num_kv_heads, dims.head_dim
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    mine = fused.chunk(tp, dim=0)[r]
    return mine.reshape(-1, *rest).clone()


# -- megatron -> HF (export) ---------------------------------------------------------------------------
def megatron_to_hf(
    tp_shards: Sequence[Mapping[str, torch.Tensor]], dims: ModelDims, shard: Shard
) -> dict[str, torch.Tensor]:
    """Merge one pipeline stage's TP slices (index = tp rank) into full HF-named tensors.

    `shard` describes the stage (its tp_rank is ignored). With tied embeddings `lm_head.weight` is
    emitted by the first stage as the embedding itself, as HF's own `state_dict()` does.
    """
    first = tp_shards[0]
    out: dict[str, torch.Tensor] = {}

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in tp_shards], dim=dim)

    if shard.pre_process:
        embed = cat("embedding.word_embeddings.weight", 0)[: dims.vocab_size]
        out["model.embed_tokens.weight"] = embed
        if dims.tied_embeddings:
            out["lm_head.weight"] = embed
    for local, layer in enumerate(shard.layers(dims)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out[hf + "input_layernorm.weight"] = first[mg + "input_layernorm.weight"].clone()
        attn = hf + "self_attn."
        q, k, v = _split_qkv(cat(mg + "self_attention.linear_qkv.weight", 0), dims)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if dims.qkv_bias:
            qb, kb, vb = _split_qkv(cat(mg + "self_attention.linear_qkv.bias", 0), dims)
            out.update({attn + "q_proj.bias": qb, attn + "k_proj.bias": kb, attn + "v_proj.bias": vb})
        out[attn + "o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        for norm in QK_NORMS if dims.qk_norm else ():
            out[attn + f"{norm[0]}.weight"] = first[mg + f"self_attention.{norm[1]}.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = first[mg + "pre_mlp_layernorm.weight"].clone()
        halves = [s[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in tp_shards]
        out[hf + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
        out[hf + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
        out[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
    if shard.post_process:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if not dims.tied_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)[: dims.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def _split_qkv(fused: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, d = dims.num_kv_heads, dims.num_heads // dims.num_kv_heads, dims.head_dim
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
