"""Token-budget micro-batches, packed or padded, and the step's minibatch plan.

Two layouts (`trainer.packing`), chosen by the attention kernel:

* `packed`: ONE row of concatenated samples (batch size 1, no padding at all). Samples are kept
  independent by position ids that restart at 0 for each sample: transformers (>= 4.56, 5.x) derives
  a block-diagonal causal mask from such position ids when no attention mask is passed (sdpa / eager /
  flex build a packed mask; flash-attention-2 uses the varlen kernel with cu_seqlens), so a packed
  forward pass equals running each sample alone (tested within 1e-5 in fp32). Only the varlen kernel
  skips the masked blocks: sdpa computes the whole T×T mask, so a row of 64 short samples costs ~64× the
  attention of the samples alone.
* `padded`: a [rows, longest] batch of right-padded samples, sorted by length so that padding is
  small. Position ids are 0..L-1 in every row and no attention mask is passed: a right pad comes after
  every real token, so causal attention already hides it, and sdpa takes its fused causal path.
  Padding positions get mask 0 and are never trained.

Per-token tensors (targets, mask, weights, ...) are flat: the row for `packed`, the rows one after the
other for `padded`, so the loss code is the same for both.

Alignment: position p of a sample holds the prediction of token p+1, so every per-token tensor is
shifted by one (`targets[p] = input_ids[p+1]`, `mask[p] = loss_mask[p+1]`); the last position of each
sample predicts nothing and has mask 0. A sampled token at position 0 has no context and is never
trained (no engine emits one: prompts are never empty).

Aggregation is folded into per-token weights so that sum(weights) over one minibatch is 1:
`token` = 1 / (trained tokens of the minibatch), `sequence` = 1 / (n_i * samples of the minibatch).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline.trainer.data import Sample
from pipeline.trainer.losses import TokenBatch


@dataclass
class MicroBatch:
    """One packed row: the model's inputs plus the loss's per-token tensors (length T)."""

    input_ids: torch.Tensor
    """[1, T] token ids of the concatenated samples."""
    position_ids: torch.Tensor
    """[1, T] positions restarting at 0 for every sample (this is what keeps samples apart)."""
    targets: torch.Tensor
    """[T] the token predicted at each position (0 where nothing is predicted)."""
    tokens: TokenBatch
    """Mask, weights, advantages, behaviour / proximal / reference log-probs."""
    sample_index: list[int]
    """Indices (into the step's samples) of the packed samples, in row order."""
    lengths: list[int]
    """Their lengths (packed: sum = T; padded: row i holds lengths[i] real tokens)."""

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding not counted)."""
        return sum(self.lengths)

    def to(self, device: torch.device) -> MicroBatch:
        t = self.tokens
        moved = TokenBatch(
            mask=t.mask.to(device),
            weights=t.weights.to(device),
            advantages=t.advantages.to(device),
            behav_logp=t.behav_logp.to(device),
            prox_logp=None if t.prox_logp is None else t.prox_logp.to(device),
            ref_logp=None if t.ref_logp is None else t.ref_logp.to(device),
            seq_index=None if t.seq_index is None else t.seq_index.to(device),
        )
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.targets.to(device),
            moved,
            self.sample_index,
            self.lengths,
        )


def pack_first_fit(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sample indices, each summing to <= `budget` tokens (first-fit decreasing).

    A sample longer than the budget gets a row of its own (it cannot be split without changing
    the computation). Ties keep input order, so the result is deterministic.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def pad_by_length(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Batches of sample indices for the padded layout: sorted by length (longest first), each batch as many
    samples as fit `rows × its longest <= budget` (at least one). Deterministic (ties keep input order)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def sample_weights(samples: Sequence[Sample], members: Sequence[int], agg: Literal["token", "sequence"]) -> np.ndarray:
    """Per-token aggregation weight of each member sample (sum over the minibatch's trained tokens = 1)."""
    trained = np.array([samples[i].trained_tokens for i in members], dtype=np.float64)
    if agg == "token":
        return np.full(len(members), 1.0 / trained.sum())
    if agg == "sequence":
        return 1.0 / (trained * len(members))
    raise ValueError(f"loss_agg must be 'token' or 'sequence', got {agg!r}")


def build_micro_batch(
    samples: Sequence[Sample], members: Sequence[int], advantages: np.ndarray, weights: dict[int, float]
) -> MicroBatch:
    """Concatenate `members` into one row with per-sample positions and shifted per-token tensors."""
    ids, pos, tgt, mask, w, adv, behav = [], [], [], [], [], [], []
    for i in members:
        s = samples[i]
        n = len(s.input_ids)
        m = np.zeros(n, dtype=np.float32)
        m[:-1] = s.loss_mask[1:]
        ids.append(s.input_ids)
        pos.append(np.arange(n))
        tgt.append(np.concatenate([s.input_ids[1:], [0]]))
        mask.append(m)
        w.append(m * weights[i])
        adv.append(m * advantages[i])
        behav.append(np.concatenate([s.logprobs[1:], [0.0]]).astype(np.float32) * m)
    tokens = TokenBatch(
        mask=torch.from_numpy(np.concatenate(mask)),
        weights=torch.from_numpy(np.concatenate(w).astype(np.float32)),
        advantages=torch.from_numpy(np.concatenate(adv).astype(np.float32)),
        behav_logp=torch.from_numpy(np.concatenate(behav)),
        seq_index=torch.from_numpy(np.repeat(np.arange(len(members)), [len(samples[i].input_ids) for i in members])),
    )
    return MicroBatch(
        input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        position_ids=torch.from_numpy(np.concatenate(pos).astype(np.int64))[None],
        targets=torch.from_numpy(np.concatenate(tgt).astype(np.int64)),
        tokens=tokens,
        sample_index=list(members),
        lengths=[len(samples[i].input_ids) for i in members],
    )


def build_padded_micro_batch(
    samples: Sequence[Sample], members: Sequence[int], advantages: np.ndarray, weights: dict[int, float]
) -> MicroBatch:
    """`members` as right-padded rows of one [rows, longest] batch; per-token tensors flattened row by row."""
    width = max(len(samples[i].input_ids) for i in members)
    rows = len(members)
    ids = np.zeros((rows, width), dtype=np.int64)
    tgt = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.float32)
    behav = np.zeros((rows, width), dtype=np.float32)
    w = np.zeros((rows, width), dtype=np.float32)
    adv = np.zeros((rows, width), dtype=np.float32)
    for r, i in enumerate(members):
        s = samples[i]
        n = len(s.input_ids)
        ids[r, :n] = s.input_ids
        tgt[r, : n - 1] = s.input_ids[1:]
        mask[r, : n - 1] = s.loss_mask[1:]
        behav[r, : n - 1] = s.logprobs[1:]
        w[r] = mask[r] * weights[i]
        adv[r] = mask[r] * advantages[i]
    tokens = TokenBatch(
        mask=torch.from_numpy(mask.ravel()),
        weights=torch.from_numpy(w.ravel()),
        advantages=torch.from_numpy(adv.ravel()),
        behav_logp=torch.from_numpy((behav * mask).ravel()),
        seq_index=torch.arange(rows).repeat_interleave(width),
    )
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.arange(width, dtype=torch.int64).expand(rows, width).contiguous(),
        targets=torch.from_numpy(tgt.ravel()),
        tokens=tokens,
        sample_index=list(members),
        lengths=[len(samples[i].input_ids) for i in members],
    )


def empty_micro_batch() -> MicroBatch:
    """A one-token row with zero weight: keeps data-parallel ranks in lock-step when one has less work."""
    zero = torch.zeros(1)
    return MicroBatch(
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        TokenBatch(zero, zero, zero, zero),
        [],
        [1],
    )


def split_minibatches(num_samples: int, minibatches: int, seed: int, step: int) -> list[list[int]]:
    """Shuffle sample indices with an RNG of its own (seed, step) and cut into near-equal minibatches.

    Seeding from (seed, step) instead of the global RNG makes the plan identical on resume, on a
    `--step N` rerun and across data-parallel ranks.
    """
    order = list(range(num_samples))
    random.Random(seed * 1_000_003 + step).shuffle(order)
    count = min(minibatches, num_samples)
    return [order[j::count] for j in range(count)] if count else []


def plan_step(
    samples: Sequence[Sample],
    advantages: np.ndarray,
    *,
    minibatches: int,
    budget: int,
    agg: Literal["token", "sequence"],
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    layout: Literal["packed", "padded"] = "packed",
) -> list[list[MicroBatch]]:
    """For each minibatch, this rank's micro-batches in `layout` (every rank gets the same count)."""
    padded = layout == "padded"
    group = pad_by_length if padded else pack_first_fit
    build = build_padded_micro_batch if padded else build_micro_batch
    plan: list[list[MicroBatch]] = []
    for members in split_minibatches(len(samples), minibatches, seed, step):
        per_sample = dict(zip(members, sample_weights(samples, members, agg).tolist(), strict=True))
        bins = group([len(samples[i].input_ids) for i in members], budget)
        rows = [[members[j] for j in b] for b in bins]
        mine = rows[rank::world_size]
        per_rank = -(-len(rows) // world_size)
        micro = [build(samples, r, advantages, per_sample) for r in mine]
        micro += [empty_micro_batch() for _ in range(per_rank - len(micro))]
        plan.append(micro)
    return plan
