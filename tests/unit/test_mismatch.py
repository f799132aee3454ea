"""Training-inference mismatch: each correction of `trainer.algorithm.mismatch` against numbers computed by
hand, and the step's mismatch metrics against a hand computation over every token, however the step is split
into minibatches, micro-batches and data-parallel ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.run.config import load_config
from pipeline.trainer.backend import MinibatchStats
from pipeline.trainer.data import Sample
from pipeline.trainer.losses import TokenBatch, behaviour_weight, policy_loss
from pipeline.trainer.metrics import ratio_percentiles
from pipeline.trainer.packing import plan_step
from schemas.config.trainer import AlgorithmConfig, MismatchConfig

# Two samples in one micro-batch: log w = prox - behav per token (index 3 is a prompt token, mask 0).
LOG_W = [0.1, 2.0, -0.4, 0.0, -1.5, 0.3]
MASK = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
SEQ = [0, 0, 0, 0, 1, 1]
# By hand: w = e^0.1 = 1.10517, e^2 = 7.38906, e^-0.4 = 0.67032 | e^-1.5 = 0.22313, e^0.3 = 1.34986.
# Geometric means: sample 0 exp((0.1 + 2.0 - 0.4) / 3) = exp(0.56667) = 1.76238; sample 1 exp(-0.6) = 0.54881.


def weights(**mismatch: object) -> tuple[list[float], list[float], list[float]]:
    prox = torch.tensor(LOG_W, dtype=torch.float64)
    w, keep, out = behaviour_weight(prox, torch.zeros(6, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64),
                                    torch.tensor(SEQ), MismatchConfig(**mismatch))  # fmt: skip
    return w.tolist(), keep.tolist(), out.tolist()


def test_token_truncate_caps_each_ratio() -> None:
    w, keep, out = weights(level="token", mode="truncate", high=2.0)
    assert w == pytest.approx([1.10517, 2.0, 0.67032, 1.0, 0.22313, 1.34986], abs=1e-5)
    assert keep == [1.0] * 6
    assert out == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_token_mask_drops_tokens_outside_the_bounds() -> None:
    w, keep, out = weights(level="token", mode="mask", low=0.5, high=2.0)
    assert w == pytest.approx([1.10517, 7.38906, 0.67032, 1.0, 0.22313, 1.34986], abs=1e-5)
    assert keep == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert out == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_sequence_truncate_gives_every_token_its_samples_capped_geometric_mean() -> None:
    w, _, _ = weights(level="sequence", mode="truncate", high=1.5)
    assert w == pytest.approx([1.5, 1.5, 1.5, 1.5, 0.54881, 0.54881], abs=1e-5)
    w, _, _ = weights(level="sequence", mode="truncate", high=None)
    assert w[:3] == pytest.approx([1.76238] * 3, abs=1e-5)


def test_sequence_mask_drops_whole_samples() -> None:
    w, keep, out = weights(level="sequence", mode="mask", low=0.6, high=2.0)
    assert w == pytest.approx([1.76238] * 4 + [0.54881] * 2, abs=1e-5)
    assert keep == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # sample 1: 0.549 < 0.6
    assert out == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_loss_uses_the_corrected_weight_and_reports_the_mismatch() -> None:
    """loss = sum_t weight_t * keep_t * (-A * ratio_t) with logp = prox (ratio 1, inside the clip)."""
    prox = torch.tensor(LOG_W, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    batch = TokenBatch(mask=mask, weights=mask / 5, advantages=mask * 2.0, behav_logp=torch.zeros_like(mask),
                       prox_logp=prox * mask, seq_index=torch.tensor(SEQ))  # fmt: skip
    out = policy_loss(prox.clone(), None, batch, AlgorithmConfig(mismatch=MismatchConfig(level="sequence", high=2.0,
                                                                                          low=0.6)))  # fmt: skip
    assert float(out.loss) == pytest.approx(-2.0 / 5 * 3 * 1.76238, abs=1e-5)  # sample 1 dropped
    k3 = sum(math.exp(d) - 1 - d for d, m in zip(LOG_W, MASK, strict=True) if m)
    assert float(out.sums["mismatch/k3"]) == pytest.approx(k3, abs=1e-9)
    assert float(out.sums["mismatch/frac_masked"]) == 2.0 and float(out.sums["mismatch/frac_clipped"]) == 2.0
    assert out.per_token["mismatch/log_ratio"].tolist() == pytest.approx([0.1, 2.0, -0.4, -1.5, 0.3])


def test_without_a_proximal_policy_there_is_no_mismatch_to_report() -> None:
    batch = TokenBatch(mask=torch.ones(2), weights=torch.full((2,), 0.5), advantages=torch.ones(2),
                       behav_logp=torch.zeros(2))  # fmt: skip
    out = policy_loss(torch.zeros(2), None, batch, AlgorithmConfig())
    assert not out.per_token and "mismatch/k3" not in out.sums


def _samples(rng: np.random.Generator, n: int) -> list[Sample]:
    out = []
    for i in range(n):
        prompt, completion = int(rng.integers(2, 5)), int(rng.integers(1, 7))
        length = prompt + completion
        mask = np.array([0] * prompt + [1] * completion, dtype=np.int8)
        behav = np.where(mask == 1, rng.normal(-2.0, 0.5, length), 0.0).astype(np.float32)
        out.append(Sample(f"s{i}", f"g{i // 2}", rng.integers(3, 50, length), mask, behav,
                          np.where(mask == 1, 0, -1).astype(np.int32), float(i % 2)))  # fmt: skip
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_step_metrics_equal_a_hand_computation_over_minibatches_micro_batches_and_ranks(
    layout: str, level: str
) -> None:
    """prox = behav + a known per-sample shift plus noise; 3 minibatches, a 12-token budget (many micro-batches),
    2 ranks, each micro-batch's diagnostics summed (and values concatenated) as the backend and the loop do."""
    rng = np.random.default_rng(0)
    samples = _samples(rng, 11)
    shift = {s.sample_id: rng.normal(0, 0.6, len(s.input_ids)) for s in samples}
    algo = AlgorithmConfig(mismatch=MismatchConfig(level=level, mode="mask", low=0.7, high=1.6))  # type: ignore[arg-type]
    per_rank = []
    for rank in range(2):
        plan = plan_step(samples, np.ones(len(samples)), minibatches=3, budget=12, agg="token", seed=0, step=0,
                         rank=rank, world_size=2, layout=layout)  # type: ignore[arg-type]  # fmt: skip
        updates = []
        for minibatch in plan:
            sums: dict[str, float] = {}
            values: list[torch.Tensor] = []
            for micro in minibatch:
                t = micro.tokens
                prox = t.behav_logp.clone()
                if micro.sample_index:  # padded rows / packed segments, in the order `seq_index` numbers them
                    width = len(t.mask) // len(micro.sample_index) if layout == "padded" else None
                    start = 0
                    for i in micro.sample_index:
                        n = len(samples[i].input_ids)
                        d = np.concatenate([shift[samples[i].sample_id][1:], [0.0]])  # shifted like the packer's
                        prox[start : start + n] += torch.from_numpy(d).float() * t.mask[start : start + n]
                        start += width if width else n
                out = policy_loss(prox.clone(), None, TokenBatch(t.mask, t.weights, t.advantages, t.behav_logp,
                                                                 prox * t.mask, None, t.seq_index), algo)  # fmt: skip
                for k, v in out.sums.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                values += out.per_token.values()
            updates.append(
                MinibatchStats(0.0, 0.0, 0.0, 0, sums, {}, {"mismatch/log_ratio": torch.cat(values).numpy()})
            )
        per_rank.append(updates)
    # What reduce_stats does across ranks: sums added, values concatenated.
    merged = [MinibatchStats(0.0, 0.0, 0.0, 0, {k: a.sums[k] + b.sums[k] for k in a.sums}, {},
                             {k: np.concatenate([a.values[k], b.values[k]]) for k in a.values})
              for a, b in zip(*per_rank, strict=True)]  # fmt: skip
    tokens = sum(u.sums["tokens"] for u in merged)

    # By hand, sample by sample: every sampled token after position 0 once.
    log_w, out_of_bounds = [], 0
    for s in samples:
        d = shift[s.sample_id][1:][s.loss_mask[1:] == 1].astype(np.float32).astype(np.float64)
        log_w.append(d)
        judged = np.exp(d) if level == "token" else np.full(len(d), np.exp(d.mean()))
        out_of_bounds += int(((judged < 0.7) | (judged > 1.6)).sum())
    every = np.concatenate(log_w)
    assert tokens == len(every)
    assert sum(u.sums["mismatch/k3"] for u in merged) / tokens == pytest.approx(np.mean(np.exp(every) - 1 - every),
                                                                                  rel=1e-5)  # fmt: skip
    assert sum(u.sums["mismatch/frac_masked"] for u in merged) == out_of_bounds
    assert sum(u.sums["mismatch/frac_clipped"] for u in merged) == out_of_bounds
    stats = ratio_percentiles(merged)
    ratio = np.exp(every)
    assert stats["mismatch/ratio_min"] == pytest.approx(ratio.min(), rel=1e-5)
    assert stats["mismatch/ratio_max"] == pytest.approx(ratio.max(), rel=1e-5)
    for q in (1, 50, 99):
        assert stats[f"mismatch/ratio_p{q}"] == pytest.approx(np.percentile(ratio, q), rel=1e-5)


def test_old_keys_are_refused_with_the_new_one_named() -> None:
    with pytest.raises(ConfigError, match=r"behav_imp_cap.*replaced: write trainer\.algorithm\.mismatch\.high"):
        load_config(None, ["trainer.algorithm.behav_imp_cap=3"])
    with pytest.raises(ConfigError, match=r"mismatch\.low needs mode=mask"):
        load_config(None, ["trainer.algorithm.mismatch.mode=truncate", "trainer.algorithm.mismatch.low=0.5"])
    assert load_config(None, ["trainer.algorithm.mismatch.level=sequence"]).trainer.algorithm.mismatch.high == 5.0
