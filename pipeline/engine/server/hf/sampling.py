"""Next-token sampling for a batch of sequences with per-row parameters, SGLang semantics.

What the returned log-probability means (matches SGLang's `Sampler`, checked against
`python/sglang/srt/layers/sampler.py`):

* greedy rows (temperature < 1e-6): `log_softmax(logits)[token]`, the unscaled distribution;
* sampled rows, default: `log(softmax(logits / temperature))[token]`, the *temperature-scaled*
  distribution over the whole vocabulary, *before* top-k / top-p / min-p truncation (those only
  decide which tokens may be drawn);
* sampled rows with `return_original_logprob` (SGLang's env `SGLANG_RETURN_ORIGINAL_LOGPROB=1`):
  `log_softmax(logits)[token]`, unscaled, whatever the temperature.

Top logprobs (`top_logprobs_num` k > 0 on a row) are the k largest entries of that same
distribution (the one the row's token logprob is read from), most likely first; rows that ask for
none cost nothing extra, and a batch where no row asks skips the top-k entirely.

Prompt logprobs (`prompt_logprobs`, for `logprob_start_len` >= 0) are SGLang's input logprobs:
`log_softmax(logits)` of the raw logits in fp32, never temperature-scaled, whatever the row samples with.

top-p keeps a token when the probability mass *before* it (in descending order) is <= top_p,
top-k keeps the k most likely, min-p keeps tokens with p >= min_p * p_max; the kept mass is
sampled proportionally (SGLang's torch fallback does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.engine.server.requests import PromptLogprobs
from pipeline.engine.tokens import TopEntry

GREEDY_EPS = 1e-6
PROMPT_CHUNK_ROWS = 256
"""Prompt positions per fp32 log_softmax: bounds the extra memory to 256 x vocabulary floats."""


@dataclass
class RowSampling:
    """Sampling parameters of one row of the batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    top_logprobs_num: int = 0
    """How many of the most likely tokens (with logprobs) to report for this row; 0 = none."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class Sampled:
    """One sampling step: per row, the token, its logprob and (rows that asked) the top logprobs."""

    tokens: list[int]
    logprobs: list[float]
    top: list[TopEntry | None] = field(default_factory=list)


def sample_next(
    logits: torch.Tensor,
    rows: list[RowSampling],
    *,
    generator: torch.Generator | None = None,
    return_original_logprob: bool = False,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, V]; return the tokens and their log-probabilities."""
    out = sample_batch(logits, rows, generator=generator, return_original_logprob=return_original_logprob)
    return out.tokens, out.logprobs


def sample_batch(
    logits: torch.Tensor,
    rows: list[RowSampling],
    *,
    generator: torch.Generator | None = None,
    return_original_logprob: bool = False,
) -> Sampled:
    """`sample_next`, plus the top logprobs of the rows with `top_logprobs_num` > 0."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling rows")
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    source = raw_logprobs  # per row, the distribution its returned logprobs are read from
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if len(sampled) == len(rows):  # every row samples (the usual case): no row indexing
        scaled_logprobs = _scaled(logits, raw_logprobs, rows)
        tokens = _draw(scaled_logprobs.exp(), rows, generator)
        source = raw_logprobs if return_original_logprob else scaled_logprobs
    else:
        tokens = torch.argmax(logits, dim=-1)
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            sub_rows = [rows[i] for i in sampled]
            scaled_logprobs = _scaled(logits[index], raw_logprobs[index], sub_rows)
            tokens[index] = _draw(scaled_logprobs.exp(), sub_rows, generator)
            if not return_original_logprob:
                source = raw_logprobs.index_copy(0, index, scaled_logprobs)
    chosen = source.gather(1, tokens[:, None])[:, 0]
    return Sampled(tokens.tolist(), chosen.tolist(), _top(source, rows))


def _scaled(logits: torch.Tensor, raw_logprobs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """`log_softmax(logits / temperature)` per row; the raw logprobs themselves when every temperature is 1."""
    if all(r.temperature == 1.0 for r in rows):
        return raw_logprobs  # dividing by 1 changes nothing
    temps = torch.tensor([r.temperature for r in rows], device=logits.device, dtype=logits.dtype)
    return torch.log_softmax(logits / temps[:, None], dim=-1)


def _top(source: torch.Tensor, rows: list[RowSampling]) -> list[TopEntry | None]:
    """The `top_logprobs_num` largest logprobs of each row that asks (one topk call for all of them)."""
    want = [i for i, r in enumerate(rows) if r.top_logprobs_num > 0]
    top: list[TopEntry | None] = [None] * len(rows)
    if not want:
        return top
    k = min(max(rows[i].top_logprobs_num for i in want), source.shape[-1])
    values, ids = source[torch.tensor(want, device=source.device)].topk(k, dim=-1)  # sorted, largest first
    for row, vals, toks in zip(want, values.tolist(), ids.tolist(), strict=True):
        n = min(rows[row].top_logprobs_num, k)
        top[row] = list(zip(vals[:n], toks[:n], strict=True))
    return top


def _draw(probs: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row of `probs` after top-k / top-p / min-p truncation."""
    needs_filter = any(r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0.0 for r in rows)
    if needs_filter:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = _truncate(sorted_probs, rows)
    else:
        sorted_probs, order = probs, None
    picks = _invert_cdf(sorted_probs, rows, generator)
    return picks if order is None else order.gather(1, picks[:, None])[:, 0]


def _invert_cdf(weights: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of `weights` (>= 0, any scale), index i with probability weights[i] / sum.

    Inverse transform sampling: one uniform per row, located in the row's cumulative sum (float64, so
    rounding does not shift the mass of rare tokens). Why not `torch.multinomial`: on CPU it draws one
    random number per vocabulary entry (~0.4 ms for 32 x 512, a tenth of a tiny model's decode step)
    where this draws one per row (~0.03 ms); the distribution is the same.
    """
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(weights.shape[0], 1, generator=generator, dtype=torch.float64, device=weights.device)
    for i, row in enumerate(rows):  # rows with their own seed draw from their own generator (reproducible per request)
        if row.generator is not None:
            u[i] = torch.rand(1, generator=row.generator, dtype=torch.float64, device=weights.device)
    # Strictly below the total, so the first entry whose cumulative sum exceeds it has weight > 0.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _truncate(sorted_probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    device, dtype = sorted_probs.device, sorted_probs.dtype
    vocab = sorted_probs.shape[-1]
    top_p = torch.tensor([r.top_p for r in rows], device=device, dtype=dtype)
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)
    min_p = torch.tensor([r.min_p for r in rows], device=device, dtype=dtype)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = before > top_p[:, None]
    drop |= torch.arange(vocab, device=device)[None, :] >= top_k[:, None]
    drop |= sorted_probs < (sorted_probs[:, :1] * min_p[:, None])
    drop[:, 0] = False  # the most likely token always survives
    return sorted_probs.masked_fill(drop, 0.0)


def prompt_logprobs(logits: torch.Tensor, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:
    """SGLang's input logprobs of `input_ids[start:]` from `logits` [K, V], the logits of the prompt's last K
    positions (K >= len(input_ids) - start). Position i > start gets `log_softmax(logits[i - 1])[input_ids[i]]`,
    position `start` None (as SGLang); with `top_k`, each position's k most likely tokens too."""
    n = len(input_ids)
    if start >= n:
        return PromptLogprobs([], [])
    offset = n - logits.shape[0]  # the prompt position of logits row 0
    if offset > start:
        raise ValueError(f"logits cover positions {offset}..{n - 1}, not {start}")
    targets = torch.tensor(input_ids[start + 1 :], device=logits.device)
    values: list[float | None] = [None]
    top: list[TopEntry | None] = [None] if top_k > 0 else []
    for lo in range(start, n - 1, PROMPT_CHUNK_ROWS):
        hi = min(lo + PROMPT_CHUNK_ROWS, n - 1)
        logprobs = torch.log_softmax(logits[lo - offset : hi - offset].float(), dim=-1)
        values += logprobs.gather(1, targets[lo - start : hi - start, None])[:, 0].tolist()
        if top_k > 0:
            vals, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            top += [list(zip(v, t, strict=True)) for v, t in zip(vals.tolist(), ids.tolist(), strict=True)]
    return PromptLogprobs(values, top)
