"""One micro-batch through the megatron model: packed inputs in, per-token log-probs out.

A `MicroBatch` (packing.py) is one row of concatenated samples. Megatron gets it as a `thd`
packed sequence: `cu_seqlens` at the sample boundaries (rope restarts per sample, attention is
block-diagonal causal, see sdpa_attention.py). With sequence parallelism the row length must be a
multiple of tp, so a padding "sample" of token 0 is appended; its logits are dropped.

Log-probs under tensor parallelism: each TP rank holds the logits of a vocab slice [T, V/tp].
log p(target) = logit[target] - logsumexp(all logits) is assembled with two all-reduces over the
TP group (max and sum-exp for the logsumexp, the target logit from the rank that owns it),
through megatron's `reduce_from_tensor_model_parallel_region` (forward all-reduce, backward
identity: every TP rank backpropagates the same replicated loss). Padded vocab columns (vocab
rounded up to a multiple of tp) are excluded. With tp == 1 the shared `losses.gather_logprobs` /
`entropy_from_logits` are used as they are, so the numerics equal the torch backend's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.trainer.losses import entropy_from_logits, gather_logprobs
from pipeline.trainer.packing import MicroBatch


@dataclass
class PackedInputs:
    input_ids: torch.Tensor
    """[1, T_padded] token ids."""
    position_ids: torch.Tensor
    """[1, T_padded] (unused by rope, which reads cu_seqlens; kept for megatron's signature)."""
    packed: Any
    """megatron `PackedSeqParams` (thd)."""
    num_tokens: int
    """T: the real tokens (the rest is padding for sequence parallelism)."""

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])


def pack_inputs(micro: MicroBatch, device: torch.device, multiple: int = 1) -> PackedInputs:
    """Megatron inputs for a micro-batch, padded to a multiple of `multiple` tokens (tp under SP)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = list(micro.lengths)
    total = sum(lengths)
    if total != micro.num_tokens:
        raise ValueError(f"micro-batch lengths sum to {total} but the row has {micro.num_tokens} tokens")
    pad = (-total) % multiple
    ids, pos = micro.input_ids, micro.position_ids
    if pad:
        lengths.append(pad)
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], dim=1)
    # cu_seqlens stays on the CPU, also on a GPU: the thd consumers of the local spec (megatron's rope,
    # which calls .tolist()/.item() on it in every layer, and SDPAAttention's per-sample slices) read it on
    # the host, and a CUDA copy made each of those reads a device sync (several per layer per micro-batch).
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    longest = max(lengths)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return PackedInputs(ids.to(device), pos.to(device), packed, total)


def run_stage(model: Any, inputs: PackedInputs, input_tensor: torch.Tensor | None) -> torch.Tensor:
    """One pipeline stage's forward: hidden states [T', 1, h] out of a middle stage, local logits [T, V/tp] out of
    the last. `input_tensor` is the previous stage's output (None on the first stage)."""
    model.set_input_tensor(input_tensor)
    out = model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=None,
        packed_seq_params=inputs.packed,
    )
    if model.post_process:
        return out[0, : inputs.num_tokens]  # GPTModel returns logits batch-first: [1, T_padded, V/tp]
    return out


@dataclass(frozen=True)
class VocabShard:
    """Which vocab columns of the logits this TP rank holds, and how many are real (not padding)."""

    start: int
    valid: int
    tp: int
    group: Any = None

    @classmethod
    def of(cls, vocab_size: int, padded_vocab: int, tp_rank: int, tp: int, group: Any = None) -> VocabShard:
        per_rank = padded_vocab // tp
        start = tp_rank * per_rank
        return cls(start, max(0, min(per_rank, vocab_size - start)), tp, group)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [T] fp32, entropy [T] fp32 or None) from this rank's logits [T, V/tp]."""
    if shard.tp == 1:
        logits = logits[:, : shard.valid]
        return gather_logprobs(logits, targets), entropy_from_logits(logits) if with_entropy else None
    return _vocab_parallel(logits, targets, shard, with_entropy)


def _vocab_parallel(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits[:, : shard.valid].float()
    with torch.no_grad():
        if shard.valid:
            shift = logits.max(dim=-1).values
        else:
            shift = torch.full(logits.shape[:1], float("-inf"), device=logits.device)
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=shard.group)
    shifted = logits - shift[:, None]
    sum_exp = tp_sum(shifted.exp().sum(dim=-1), shard.group)
    lse = shift + sum_exp.log()
    local = targets - shard.start
    owned = (local >= 0) & (local < shard.valid)
    picked = shifted.gather(-1, local.clamp(0, max(shard.valid - 1, 0))[:, None])[:, 0] if shard.valid else shift * 0
    target_shifted = tp_sum(torch.where(owned, picked, torch.zeros_like(picked)), shard.group)
    logp = target_shifted - sum_exp.log()
    if not with_entropy:
        return logp, None
    probs = (logits - lse[:, None]).exp()
    expected = tp_sum((probs * logits).sum(dim=-1), shard.group)
    return logp, lse - expected
