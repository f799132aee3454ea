"""Verifying a weight swap: does a server hold the version the trainer just sent?

Two checks through SGLang's own HTTP API, so they work against a real SGLang as well as the `hf`
engine and the vLLM adapter (docs/reliability.md, "Verified weight swaps"):

- **behaviour** (every engine, every model): a fixed probe sequence is scored by the server
  (`/generate` with `return_logprob` and `logprob_start_len: 0`; SGLang's layout gives each prompt
  position `[logprob, token_id, text]`, the first one's logprob null) and compared with the
  log-probabilities the trainer computes from the very tensors it published, position by position,
  within the served dtype's tolerance (`TOLERANCES`). A tensor that arrived wrong (bits flipped,
  the wrong dtype, under the wrong name) changes them far beyond the tolerance: +1.0 on one MLP
  weight of the tiny model moves them by ~0.6, fp32 noise is ~1e-6.
- **weights** (where the server can show them): a deterministic sample of parameters (every kind of
  layer, the embeddings, the last norm, a tied `lm_head` too), read back with `/get_weights_by_name`
  (its first rows) and compared with the trainer's tensors rounded to the served dtype. SGLang
  implements that route only for some model classes; for the others (Qwen2/Qwen3 among them) it
  answers 400 "Get parameter by name failed": that means "not supported" (recorded once per server),
  never "bad server", and the probe alone decides.

Every failure names the server, the probe position or tensor element, and both values. The
reference model (`ProbeModel`) lives on the trainer's rank 0, in fp32 on CPU: one forward of the
probe per version, a small fraction of a swap (measured by `benchmarks/weight_sync.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.engine.client.wire import EngineError

log = logging.getLogger("arl.trainer.verify")

PROBE_TOKENS = 32
WEIGHT_ROWS = 4
"""Rows read back per sampled parameter (`truncate_size`): SGLang returns the first rows only."""
UNSUPPORTED = "Get parameter by name failed"
"""SGLang's 400 answer from `/get_weights_by_name` for a model class that does not implement it."""


@dataclass(frozen=True)
class Tolerance:
    logprob_atol: float
    """Largest allowed |server - trainer| of any probe position's log-probability."""
    weight_atol: float
    """Largest allowed |server - trainer| of a weight element, after rounding the trainer's to the served dtype."""


TOLERANCES: dict[str, Tolerance] = {
    # Measured on the tiny model, hf server on CPU vs this fp32 reference: fp32 0.0 (the same kernels), fp16
    # 4.5e-4, bf16 3.5e-3. The margins leave room for GPU kernels and bigger models (docs/reliability.md).
    "float32": Tolerance(logprob_atol=2e-3, weight_atol=1e-6),
    "float16": Tolerance(logprob_atol=0.01, weight_atol=1e-6),
    "bfloat16": Tolerance(logprob_atol=0.05, weight_atol=1e-6),
}


def tolerance_for(dtype: str, logprob_atol: float | None = None) -> Tolerance:
    """The served dtype's tolerance; `logprob_atol` (`trainer.verify_tolerance`) overrides the probe's."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no verification tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}")
    tol = TOLERANCES[dtype]
    return tol if logprob_atol is None else Tolerance(logprob_atol, tol.weight_atol)


@dataclass
class Expected:
    """What a server holding `version` must answer."""

    version: int
    probe: list[int]
    logprobs: list[float]
    """The probe's log-probabilities for positions 1.. (position 0 has none)."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sampled parameter name -> its first `WEIGHT_ROWS` rows, rounded to the served dtype, as fp32."""
    adapter: str | None = None
    """The LoRA adapter the probe names (adapter publication): the server's own weights stay the base's, so only
    the probe checks (no weights are sampled)."""


@dataclass
class Verdict:
    url: str
    ok: bool
    problem: str | None = None
    weights_supported: bool | None = None
    """Whether the server answered `/get_weights_by_name` (None: not asked)."""
    probe_max_diff: float = math.nan
    weights_checked: int = 0
    seconds: float = 0.0


def probe_ids(vocab_size: int, special: set[int], seed: int, length: int = PROBE_TOKENS) -> list[int]:
    """A fixed pseudo-random token sequence (the same for every version), avoiding special tokens: random
    ids reach many embedding rows and attention patterns, which a natural sentence would not."""
    rng = np.random.default_rng(seed)
    # Not the last id either: SGLang reports a prompt token >= vocab_size - 1 as id 0 in its logprobs.
    pool = np.array([i for i in range(min(vocab_size - 1, 50_000)) if i not in special])
    return [int(i) for i in rng.choice(pool, size=length, replace=False)]


def weight_sample(names: list[str], version: int, tied: bool) -> list[str]:
    """One parameter of each kind (the layer index rotating with the version, so every layer is read
    over successive versions), plus every non-layer parameter; `lm_head.weight` when tied too."""
    kinds: dict[str, list[str]] = {}
    for name in sorted(names):
        kinds.setdefault(re.sub(r"\.\d+\.", ".N.", name), []).append(name)
    layered = lambda n: sorted(n, key=lambda s: [int(t) if t.isdigit() else 0 for t in s.split(".")])  # noqa: E731
    sample = [layered(group)[version % len(group)] for group in kinds.values()]
    if tied and "lm_head.weight" not in sample:
        sample.append("lm_head.weight")
    return sample


class ProbeModel:
    """The trainer's reference: the model's architecture in fp32 on CPU, loaded with each published version."""

    def __init__(self, model_dir: Path, tied: bool) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.random.fork_rng():  # its random init must not move the trainer's RNG (bitwise resume)
            self.model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.tied = tied
        self.vocab_size = int(config.vocab_size)
        special = {getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        self.special = {int(i) for i in special if isinstance(i, int)}

    @torch.no_grad()
    def logprobs(self, state_dict: dict[str, torch.Tensor], probe: list[int]) -> list[float]:
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(torch.float32) for k, v in state_dict.items()}, strict=False
        )
        allowed = {"lm_head.weight"} if self.tied else set()
        if unexpected or set(missing) - allowed:
            raise ValueError(
                f"published tensors do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if self.tied:
            self.model.tie_weights()
        ids = torch.tensor([probe])
        logits = self.model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        return logp.gather(1, ids[0, 1:, None])[:, 0].tolist()


class Verifier:
    """Builds each version's expectations on the trainer and checks servers against them."""

    def __init__(
        self, model_dir: Path, dtype: str, tied: bool, *, seed: int = 0, logprob_atol: float | None = None
    ) -> None:
        self.dtype = dtype
        self.tol = tolerance_for(dtype, logprob_atol)
        self.tied = tied
        self.reference = ProbeModel(model_dir, tied)
        self.probe = probe_ids(self.reference.vocab_size, self.reference.special, seed)
        self.weights_supported: dict[str, bool] = {}
        """Per server URL: whether it answers `/get_weights_by_name` (logged once when it does not)."""

    def expect(self, version: int, state_dict: dict[str, torch.Tensor], adapter: str | None = None) -> Expected:
        """What a server holding `version` answers; `adapter`: the LoRA adapter it serves that version as."""
        served = getattr(torch, self.dtype)
        weights = {}
        for name in weight_sample(list(state_dict), version, self.tied) if adapter is None else []:
            tied_to = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            tensor = state_dict.get(name, state_dict.get(tied_to))
            if tensor is not None:
                weights[name] = tensor[:WEIGHT_ROWS].to(served).to(torch.float32)
        return Expected(version, self.probe, self.reference.logprobs(state_dict, self.probe), weights, adapter)

    async def check(self, client: Any, url: str, expected: Expected) -> Verdict:
        """Check one server (`client`: an `EngineClient`); a failure is a Verdict, never an exception."""
        t0 = time.perf_counter()
        verdict = Verdict(url, ok=True)
        try:
            served = await client.served_version(url)
            if served != expected.version:
                verdict.problem = f"{url} reports weight_version {served}, expected {expected.version}"
            else:
                scored = await client.score_prompt(url, expected.probe, lora_path=expected.adapter)
                verdict.problem = self._compare_probe(url, scored, expected, verdict)
            if verdict.problem is None and self.weights_supported.get(url, True) and expected.weights:
                verdict.problem = await self._compare_weights(client, url, expected, verdict)
        except EngineError as exc:
            verdict.problem = f"{url}: verification call failed: {exc}"
        verdict.ok = verdict.problem is None
        verdict.seconds = time.perf_counter() - t0
        return verdict

    def _compare_probe(self, url: str, scored: list[Any], expected: Expected, verdict: Verdict) -> str | None:
        if len(scored) != len(expected.probe):
            return f"{url}: probe scored {len(scored)} positions, sent {len(expected.probe)}"
        ids = [int(entry[1]) for entry in scored]
        if ids != expected.probe:
            first = next(i for i, (a, b) in enumerate(zip(ids, expected.probe, strict=True)) if a != b)
            return f"{url}: probe position {first} came back as token {ids[first]}, sent {expected.probe[first]}"
        got = [float("nan") if entry[0] is None else float(entry[0]) for entry in scored[1:]]
        diffs = [abs(a - b) for a, b in zip(got, expected.logprobs, strict=True)]
        worst = max(range(len(diffs)), key=lambda i: -1.0 if math.isnan(diffs[i]) else diffs[i])
        nan = next((i for i, d in enumerate(diffs) if math.isnan(d)), None)
        verdict.probe_max_diff = math.inf if nan is not None else diffs[worst]
        i = nan if nan is not None else worst
        if nan is not None or diffs[i] > self.tol.logprob_atol:
            return (
                f"{url}: probe position {i + 1} (token {expected.probe[i + 1]}): server logprob {got[i]:.6f}, "
                f"trainer {expected.logprobs[i]:.6f} (|diff| {diffs[i]:.3g} > {self.tol.logprob_atol} for "
                f"{self.dtype}) at version {expected.version}"
            )
        return None

    async def _compare_weights(self, client: Any, url: str, expected: Expected, verdict: Verdict) -> str | None:
        names = list(expected.weights)
        answers = await asyncio.gather(
            *(client.weights_by_name(url, n, WEIGHT_ROWS) for n in names), return_exceptions=True
        )
        for name, rows in zip(names, answers, strict=True):
            want = expected.weights[name]
            if isinstance(rows, EngineError):
                if rows.status in (400, 404) and (UNSUPPORTED in str(rows) or rows.status == 404):
                    self.weights_supported[url] = False
                    verdict.weights_supported = False
                    log.info("%s cannot show its weights (%s); its swaps are verified by the probe only", url, rows)
                    return None
                raise rows
            if isinstance(rows, BaseException):
                raise rows
            verdict.weights_supported = self.weights_supported[url] = True
            got = torch.tensor(rows, dtype=torch.float32)
            if got.shape != want.shape:
                return f"{url}: weight {name}: first rows have shape {list(got.shape)}, expected {list(want.shape)}"
            diff = (got - want).abs()
            if not bool(torch.isfinite(got).all()) or float(diff.max()) > self.tol.weight_atol:
                flat = int(torch.nan_to_num(diff, nan=math.inf).argmax())
                index = list(np.unravel_index(flat, tuple(got.shape)))
                return (
                    f"{url}: weight {name}{[int(j) for j in index]}: server {got.flatten()[flat].item():.8g}, "
                    f"trainer {want.flatten()[flat].item():.8g} at version {expected.version}"
                )
            verdict.weights_checked += 1
        return None
