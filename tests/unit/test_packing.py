"""Packing: bins respect the budget, every sample is trained exactly once on exactly one rank, and a
packed row computes the same log-probs, loss and gradients as the samples run one at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.trainer.data import rows_to_samples
from pipeline.trainer.losses import gather_logprobs, policy_loss
from pipeline.trainer.packing import (
    build_micro_batch,
    build_padded_micro_batch,
    pack_first_fit,
    pad_by_length,
    plan_step,
    sample_weights,
)
from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows
from schemas.config.trainer import AlgorithmConfig


def test_first_fit_respects_budget_and_places_everything_once() -> None:
    lengths = [5, 17, 9, 30, 1, 12, 12, 40, 3]
    bins = pack_first_fit(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 32 or len(b) == 1  # 40 > budget travels alone
    assert [7] in bins
    assert len(bins) == 4  # FFD: 40 | 30+1 | 17+12+3 | 12+9+5 (89 tokens in 3 rows of 32 is optimal)
    assert pack_first_fit(lengths, 32) == bins


def _samples(lens: list[int], groups: int = 3, size: int = 4) -> list:
    return rows_to_samples(synthetic_rows(0, num_groups=groups, group_size=size, completion_lens=lens))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_plan_covers_every_sample_once_with_unit_weight(world: int, agg: str) -> None:
    samples = _samples([3, 9, 5, 14, 7])
    adv = np.linspace(-1, 1, len(samples))
    plans = [plan_step(samples, adv, minibatches=2, budget=40, agg=agg, seed=3, step=5, rank=r, world_size=world)
             for r in range(world)]  # type: ignore[arg-type]  # fmt: skip
    seen = sorted(i for plan in plans for mb in plan for micro in mb for i in micro.sample_index)
    assert seen == list(range(len(samples)))
    for j in range(2):
        assert len({len(plan[j]) for plan in plans}) == 1  # ranks in lock-step
        total = sum(float(micro.tokens.weights.sum()) for plan in plans for micro in plan[j])
        assert total == pytest.approx(1.0, abs=1e-6)


def test_sequence_weights_average_per_sample_first() -> None:
    samples = _samples([2, 6], groups=1, size=2)
    w = sample_weights(samples, [0, 1], "sequence")
    assert w.tolist() == pytest.approx([1 / (2 * 2), 1 / (6 * 2)])  # 1 / (n_i * num_samples)


def test_packed_row_equals_samples_alone(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    rows = add_behaviour_logprobs(synthetic_rows(0, num_groups=2, group_size=3, completion_lens=[4, 11, 7]),
                                  tiny_model_dir)  # fmt: skip
    samples = rows_to_samples(rows)
    adv = np.array([1.0, -0.5, 0.3, -1.0, 0.8, -0.2])
    members = list(range(len(samples)))
    weights = dict(zip(members, sample_weights(samples, members, "token").tolist(), strict=True))
    algo = AlgorithmConfig(clip_eps=0.2, kl_coef=0.0)

    def loss_and_grads(micro_batches: list) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logps, total = [], 0.0
        for micro in micro_batches:
            logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False).logits
            logp = gather_logprobs(logits.reshape(-1, logits.shape[-1]), micro.targets)
            out = policy_loss(logp, None, micro.tokens, algo)
            out.loss.backward()
            total += float(out.loss.detach())
            logps.append(logp.detach() * micro.tokens.mask)
        return torch.cat(logps), total, [p.grad.clone() for p in model.parameters()]

    packed = [build_micro_batch(samples, members, adv, weights)]
    alone = [build_micro_batch(samples, [i], adv, weights) for i in members]
    lp_packed, loss_packed, g_packed = loss_and_grads(packed)
    lp_alone, loss_alone, g_alone = loss_and_grads(alone)
    assert packed[0].num_tokens == sum(len(s.input_ids) for s in samples)  # no padding at all
    assert (lp_packed - lp_alone).abs().max().item() < 1e-5
    assert loss_packed == pytest.approx(loss_alone, abs=1e-6)
    for a, b in zip(g_packed, g_alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    # Padded rows (two batches, so the budget split is exercised): the same log-probs, loss and gradients.
    padded = [build_padded_micro_batch(samples, members[:4], adv, weights),
              build_padded_micro_batch(samples, members[4:], adv, weights)]  # fmt: skip
    lp_padded, loss_padded, g_padded = loss_and_grads(padded)
    assert loss_padded == pytest.approx(loss_alone, abs=1e-6)
    for a, b in zip(g_padded, g_alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    real = torch.cat([unpad(m, lp) for m, lp in zip(padded, lp_padded.split([m.targets.numel() for m in padded]),
                                                    strict=True)])  # fmt: skip
    assert (real - lp_alone).abs().max().item() < 1e-5
    # Behaviour log-probs from one-at-a-time teacher forcing match the packed forward, too.
    behav = torch.cat([m.tokens.behav_logp for m in alone])
    assert (lp_packed - behav).abs().max().item() < 1e-5


def unpad(micro, flat: torch.Tensor) -> torch.Tensor:
    """A padded micro-batch's per-token values without the padding, samples in row order."""
    rows = flat.reshape(len(micro.lengths), -1)
    return torch.cat([rows[r, :n] for r, n in enumerate(micro.lengths)])


def test_padded_batches_respect_the_budget_sorted_by_length() -> None:
    lengths = [5, 17, 9, 30, 1, 12, 12, 40, 3]
    batches = pad_by_length(lengths, 48)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 48 or len(b) == 1
    assert batches == [[7], [3], [1, 5], [6, 2, 0, 8], [4]]  # longest first (4 x 12 = 48 fits); ties in order
    micro = build_padded_micro_batch(_samples([3, 9]), [0, 1], np.zeros(6), {0: 1.0, 1: 1.0})
    assert micro.input_ids.shape == (2, max(micro.lengths)) and micro.num_tokens == sum(micro.lengths)
    assert micro.tokens.mask.reshape(2, -1)[0, micro.lengths[0] - 1 :].sum() == 0  # no loss on padding


def test_plan_layouts_cover_the_same_samples_with_the_same_weight() -> None:
    samples = _samples([3, 9, 5, 14, 7])
    adv = np.linspace(-1, 1, len(samples))
    for layout in ("packed", "padded"):
        (plan,) = plan_step(samples, adv, minibatches=1, budget=64, agg="token", seed=0, step=0, layout=layout)
        assert sorted(i for m in plan for i in m.sample_index) == list(range(len(samples)))
        assert sum(float(m.tokens.weights.sum()) for m in plan) == pytest.approx(1.0, abs=1e-6)


def test_packing_without_position_ids_would_leak_across_samples(tiny_model_dir: Path) -> None:
    """Guards the mechanism: if position ids stopped separating samples, this test sees the leak."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    samples = _samples([6, 6], groups=1, size=2)
    micro = build_micro_batch(samples, [0, 1], np.zeros(2), {0: 1.0, 1: 1.0})
    with torch.no_grad():
        with_pos = model(input_ids=micro.input_ids, position_ids=micro.position_ids).logits
        without = model(input_ids=micro.input_ids).logits
    n0 = micro.lengths[0]
    assert torch.allclose(with_pos[:, :n0], without[:, :n0], atol=1e-5)
    assert not torch.allclose(with_pos[:, n0:], without[:, n0:], atol=1e-3)
