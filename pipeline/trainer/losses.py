"""Policy losses as pure functions over flat token tensors (one implementation for every backend).

Every tensor here is 1-D over the tokens of one micro-batch, aligned so that position t holds the
log-probability of the token *predicted* at t (see `packing.py`). Aggregation (token- or
sequence-level mean over a minibatch) is folded into per-token `weights` built by the packer, so a
micro-batch's loss is `sum(weights * per_token_loss)` and the sum over micro-batches (and over
data-parallel ranks) is exactly the minibatch loss, whatever the packing.

Decoupled PPO (AReaL, "Decoupled PPO objective"): with behaviour log-probs `behav` (the engine
that sampled), proximal log-probs `prox` (the policy at the start of the step) and current `logp`,

    ratio   = exp(logp - prox)                                  (trust region around prox)
    pg      = max(-A * ratio, -A * clip(ratio, 1 - eps_lo, 1 + eps_hi))
    w_behav = exp(prox - behav)                                 (off-policy correction)
    loss_t  = w_behav * pg          with w_behav corrected by `algorithm.mismatch` (`behaviour_weight`)

When not decoupled, `prox = behav` and this is plain PPO-clip against the behaviour policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas.config.trainer import AlgorithmConfig, MismatchConfig

MISMATCH_LOG_RATIO = "mismatch/log_ratio"
"""`LossOutput.per_token` key: log pi_prox - log pi_behav of each trained token."""


@dataclass
class TokenBatch:
    """The per-token inputs of the loss for one micro-batch (all 1-D, same length T)."""

    mask: torch.Tensor
    """1.0 on tokens that are trained, 0.0 elsewhere (prompt, tool output, sample ends)."""
    weights: torch.Tensor
    """Aggregation weight per token (0 where mask is 0); sums to 1 over a whole minibatch."""
    advantages: torch.Tensor
    """The sample's advantage broadcast over its tokens."""
    behav_logp: torch.Tensor
    """Behaviour log-probs recorded by the engine."""
    prox_logp: torch.Tensor | None = None
    """Proximal log-probs (current weights before the update); None = use `behav_logp`."""
    ref_logp: torch.Tensor | None = None
    """Frozen reference log-probs; needed only when `kl_coef > 0`."""
    seq_index: torch.Tensor | None = None
    """Which sample of the micro-batch each token belongs to (0, 1, ...; int64); needed by sequence-level
    mismatch corrections. None = one sample."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate: this micro-batch's share of the minibatch loss."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached token sums of diagnostics (divide by `sums['tokens']` after summing micro-batches)."""
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached maxima of diagnostics."""
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached per-token values of the trained tokens (1-D, mask applied) for statistics that sums cannot give
    (percentiles); the backend concatenates them over micro-batches into `MinibatchStats.values`."""


@dataclass(frozen=True)
class _Terms:
    """The per-token terms of one micro-batch's loss, for its diagnostics (`_diagnostics`)."""

    logp: torch.Tensor
    """Current log-probs (with grad; detached before use)."""
    prox: torch.Tensor
    """Proximal log-probs (the behaviour ones when not decoupled)."""
    behav: torch.Tensor
    """Behaviour log-probs."""
    ratio: torch.Tensor
    """exp(logp - prox)."""
    pg_unclipped: torch.Tensor
    """-A * ratio."""
    pg_clipped: torch.Tensor
    """-A * clip(ratio)."""
    imp_weight: torch.Tensor
    """The corrected behaviour weight (`behaviour_weight`)."""
    entropy: torch.Tensor | None
    """Per-token entropy, when computed."""
    kl_ref: torch.Tensor | None
    """k3 KL to the reference, when `kl_coef > 0`."""


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from samples of pi: exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim, per position (computed in fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def logit_scale(rollout_temperature: float) -> float:
    """Factor applied to the trainer's logits so its log-probs are of the distribution that sampled.

    Inference engines (SGLang by default, our `hf` engine, vLLM with processed logprobs) report
    log softmax(logits / T) at the request's temperature T, so the PPO ratio is only meaningful if
    the trainer scales its logits by 1/T too. Greedy (T = 0) log-probs are unscaled.
    """
    return 1.0 / rollout_temperature if rollout_temperature > 0 else 1.0


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] per position, in fp32 (bf16 log-probs are too coarse for ratios)."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor | None) -> torch.Tensor:
    """Per token: the mean of `values` over the masked tokens of its sample (0 for a sample without any)."""
    if seq_index is None:
        seq_index = torch.zeros_like(mask, dtype=torch.long)
    count = int(seq_index.max()) + 1 if seq_index.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, seq_index, values * mask)
    tokens = torch.zeros(count, dtype=mask.dtype, device=mask.device).index_add_(0, seq_index, mask)
    return (sums / tokens.clamp(min=1.0))[seq_index]


def behaviour_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor | None,
    mismatch: MismatchConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(corrected weight, keep-mask, out-of-bounds indicator) per token, for w = pi_prox / pi_behav.

    The weight judged is w_t (level token) or the sample's geometric mean exp(mean_t log w_t) (level sequence);
    `truncate` returns min(weight, high), `mask` returns the weight and keep = 1[low <= weight <= high].
    Out of bounds: the weight is outside [low, high], whatever the mode (what truncation changed or masking dropped).
    """
    log_w = prox_logp - behav_logp
    if mismatch.level == "sequence":
        log_w = sequence_mean(log_w, mask, seq_index)
    weight = torch.exp(log_w)
    out = torch.zeros_like(weight, dtype=torch.bool)
    if mismatch.high is not None:
        out |= weight > mismatch.high
    if mismatch.low is not None:
        out |= weight < mismatch.low
    keep = torch.ones_like(weight)
    if mismatch.mode == "mask":
        keep = (~out).to(weight.dtype)
    elif mismatch.high is not None:
        weight = weight.clamp(max=mismatch.high)
    return weight, keep, out.to(weight.dtype)


def policy_loss(
    logp: torch.Tensor, entropy: torch.Tensor | None, batch: TokenBatch, algo: AlgorithmConfig
) -> LossOutput:
    """The PPO-clip (decoupled) loss with optional KL-to-reference and entropy terms, plus diagnostics."""
    mask = batch.mask
    adv = batch.advantages
    behav = batch.behav_logp
    prox = batch.prox_logp if batch.prox_logp is not None else behav
    eps_lo = algo.clip_eps
    eps_hi = algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps

    ratio = torch.exp(logp - prox)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    imp_weight, keep, out = behaviour_weight(prox, behav, mask, batch.seq_index, algo.mismatch)
    per_token = pg * imp_weight.detach() * keep

    kl_ref = None
    if algo.kl_coef > 0:
        if batch.ref_logp is None:
            raise ValueError("kl_coef > 0 but the batch has no reference log-probs")
        kl_ref = kl_k3(logp, batch.ref_logp)
        per_token = per_token + algo.kl_coef * kl_ref * keep
    if algo.entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        per_token = per_token - algo.entropy_coef * entropy * keep
    loss = (batch.weights * per_token).sum()
    terms = _Terms(
        logp=logp,
        prox=prox,
        behav=behav,
        ratio=ratio,
        pg_unclipped=pg_unclipped,
        pg_clipped=pg_clipped,
        imp_weight=imp_weight,
        entropy=entropy,
        kl_ref=kl_ref,
    )
    result = LossOutput(loss=loss, **_diagnostics(terms, mask))
    if batch.prox_logp is not None:  # decoupled: the behaviour-proximal mismatch (none without a proximal policy)
        _mismatch_diagnostics(result, prox, behav, mask, keep, out)
    return result


def _mismatch_diagnostics(
    result: LossOutput,
    prox: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Token sums of k3 KL(behav || prox) = E[w - 1 - log w], of out-of-bounds and dropped tokens, and the trained
    tokens' log w for the percentiles (`pipeline.trainer.metrics.mismatch_metrics`)."""
    with torch.no_grad():
        log_w = prox - behav
        result.sums["mismatch/k3"] = ((torch.exp(log_w) - 1.0 - log_w) * mask).sum()
        result.sums["mismatch/frac_clipped"] = (out * mask).sum()
        result.sums["mismatch/frac_masked"] = ((1.0 - keep) * mask).sum()
        result.per_token[MISMATCH_LOG_RATIO] = log_w[mask > 0]


def _diagnostics(terms: _Terms, mask: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Token sums and maxima of what a person watches during training (all detached)."""
    behav, imp_weight = terms.behav, terms.imp_weight
    with torch.no_grad():
        log_r = terms.logp.detach() - behav  # current vs behaviour: the policy's drift since sampling
        sums = {
            "tokens": mask.sum(),
            "kl_behav_k1": (-log_r * mask).sum(),
            "kl_behav_k3": ((torch.exp(log_r) - 1.0 - log_r) * mask).sum(),
            "clip_frac": ((terms.pg_clipped > terms.pg_unclipped).to(mask.dtype) * mask).sum(),
            "ratio": (terms.ratio.detach() * mask).sum(),
            "imp_weight": (imp_weight * mask).sum(),
            "prox_behav_diff": ((terms.prox - behav).abs() * mask).sum(),
        }
        if terms.entropy is not None:
            sums["entropy"] = (terms.entropy.detach() * mask).sum()
        if terms.kl_ref is not None:
            sums["kl_ref"] = (terms.kl_ref.detach() * mask).sum()
        neg_inf = torch.tensor(float("-inf"), dtype=imp_weight.dtype, device=imp_weight.device)
        maxima = {"imp_weight_max": torch.where(mask > 0, imp_weight, neg_inf).max()}
    return {"sums": sums, "maxima": maxima}
