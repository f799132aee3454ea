"""The policy loss and its gradient against a reference written independently here (plain floats,
derivatives by hand), on a hand-built batch that hits every branch of PPO-clip and the behaviour cap."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.losses import TokenBatch, entropy_from_logits, gather_logprobs, kl_k3, policy_loss
from schemas.config.trainer import AlgorithmConfig, MismatchConfig

# (logp, prox, behav, advantage, weight, mask): one row per token
TOKENS = [
    (-1.0, -1.5, -1.4, 1.0, 0.10, 1.0),  # A>0, ratio 1.65 > 1.28: clipped, no gradient
    (-2.0, -1.5, -1.6, 1.0, 0.15, 1.0),  # A>0, ratio 0.61 < 0.8: unclipped side is the max
    (-1.0, -1.5, -1.5, -2.0, 0.20, 1.0),  # A<0, ratio 1.65: unclipped (the pessimistic side) is the max
    (-2.0, -1.5, -1.2, -2.0, 0.05, 1.0),  # A<0, ratio 0.61: clipped, no gradient
    (-1.1, -1.0, -1.05, 0.5, 0.25, 1.0),  # in range
    (-0.5, -0.2, -3.0, 1.0, 0.25, 1.0),  # behaviour weight exp(2.8) = 16.4 > cap 5
    (-0.7, 0.0, 0.0, 3.0, 0.0, 0.0),  # prompt token: weight 0
]
REF = [-1.2, -1.8, -0.9, -2.5, -1.0, -0.6, -0.7]
ENT = [1.5, 0.3, 2.0, 0.1, 0.7, 1.1, 0.0]


def reference_loss_and_grad(algo: AlgorithmConfig) -> tuple[float, list[float]]:
    eps_lo, eps_hi = algo.clip_eps, algo.clip_eps_high or algo.clip_eps
    total, grads = 0.0, []
    for (x, p, b, a, w, _m), ref, ent in zip(TOKENS, REF, ENT, strict=True):
        r = math.exp(x - p)
        unclipped, clipped = -a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
        if unclipped >= clipped:
            pg, dpg = unclipped, -a * r
        else:
            pg, dpg = clipped, (-a * r if 1 - eps_lo < r < 1 + eps_hi else 0.0)
        imp = math.exp(p - b)
        keep, cap = 1.0, algo.mismatch.high
        if cap is not None:
            if algo.mismatch.mode == "mask":
                keep = 1.0 if imp <= cap else 0.0
            else:
                imp = min(imp, cap)
        k3 = math.exp(ref - x) - (ref - x) - 1
        dk3 = 1 - math.exp(ref - x)
        term = pg * imp * keep + algo.kl_coef * k3 * keep - algo.entropy_coef * ent * keep
        total += w * term
        grads.append(w * (dpg * imp * keep + algo.kl_coef * dk3 * keep))
    return total, grads


def run_loss(algo: AlgorithmConfig) -> tuple[float, list[float], dict]:
    cols = list(zip(*TOKENS, strict=True))
    logp = torch.tensor(cols[0], dtype=torch.float64, requires_grad=True)
    batch = TokenBatch(
        mask=torch.tensor(cols[5], dtype=torch.float64), weights=torch.tensor(cols[4], dtype=torch.float64),
        advantages=torch.tensor(cols[3], dtype=torch.float64), behav_logp=torch.tensor(cols[2], dtype=torch.float64),
        prox_logp=torch.tensor(cols[1], dtype=torch.float64), ref_logp=torch.tensor(REF, dtype=torch.float64),
    )  # fmt: skip
    out = policy_loss(logp, torch.tensor(ENT, dtype=torch.float64), batch, algo)
    out.loss.backward()
    assert logp.grad is not None
    return float(out.loss.detach()), logp.grad.tolist(), out.sums


@pytest.mark.parametrize(
    "algo",
    [
        AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28, mismatch=MismatchConfig(high=5.0, mode="mask")),
        AlgorithmConfig(
            clip_eps=0.2, mismatch=MismatchConfig(high=5.0, mode="truncate"), kl_coef=0.1, entropy_coef=0.01
        ),
        AlgorithmConfig(clip_eps=0.1, mismatch=MismatchConfig(high=None), kl_coef=0.5),
    ],
    ids=["mask-cliphigher", "cap-kl-entropy", "uncapped-kl"],
)
def test_loss_and_gradient_match_independent_reference(algo: AlgorithmConfig) -> None:
    loss, grad = run_loss(algo)[:2]
    want_loss, want_grad = reference_loss_and_grad(algo)
    assert loss == pytest.approx(want_loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    if algo.kl_coef == 0:
        assert grad[0] == 0.0 and grad[3] == 0.0  # clipped tokens carry no PPO gradient
    assert grad[1] != 0.0 and grad[2] != 0.0


def test_diagnostics_count_clipping_and_masking() -> None:
    sums = run_loss(AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28, mismatch=MismatchConfig(high=5.0, mode="mask")))[
        2
    ]
    assert float(sums["tokens"]) == 6.0
    assert float(sums["clip_frac"]) == 2.0  # tokens 0 and 3
    assert float(sums["mismatch/frac_masked"]) == 1.0  # token 5


def test_without_prox_the_ratio_is_against_behaviour() -> None:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    batch = TokenBatch(mask=torch.ones(2), weights=torch.full((2,), 0.5), advantages=torch.tensor([1.0, -1.0]),
                       behav_logp=logp.detach().clone())  # fmt: skip
    out = policy_loss(logp, None, batch, AlgorithmConfig())
    assert float(out.loss.detach()) == pytest.approx(0.0, abs=1e-7)  # ratio 1, advantages cancel
    out.loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([-0.5, 0.5])


def test_kl_requires_reference_logprobs() -> None:
    batch = TokenBatch(mask=torch.ones(1), weights=torch.ones(1), advantages=torch.ones(1), behav_logp=torch.zeros(1))
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(torch.zeros(1), None, batch, AlgorithmConfig(kl_coef=0.1))


def test_helpers_match_definitions() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]])
    probs = torch.softmax(logits, -1)
    assert gather_logprobs(logits, torch.tensor([1, 2])).tolist() == pytest.approx(
        [math.log(probs[0, 1]), math.log(1 / 3)]
    )
    assert entropy_from_logits(logits)[1].item() == pytest.approx(math.log(3))
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-2.0])).item() > 0
