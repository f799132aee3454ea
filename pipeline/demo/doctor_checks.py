"""The checks of `arl doctor`, each a function returning `Check`s (pass/fail, detail, seconds).

They read only what a finished run leaves (the run dir) and what a live inference server answers,
so each one can also be pointed at a run or a server built by hand (the tests do: a server whose
weights differ from the checkpoint must fail `check_served_weights`).

The weight check scores one probe on both sides. The server generates `PROBE_TOKENS` tokens from a
fixed prompt (seeded sampling at the run's rollout temperature, EOS ignored) and reports each
token's log-probability; the doctor then loads the trainer's checkpoint with transformers, applies
the trainer's own temperature scaling (`logit_scale`) and computes the log-probabilities of the same
tokens. Equal weights give equal numbers up to kernel and dtype noise (`TOLERANCE`); stale or
half-updated weights do not. Generated tokens are scored, not the prompt's, because every backend
reports those (SGLang's prompt logprobs have no counterpart in the hf engine or vLLM adapter).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run.handoff import read_json
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 34 56 78"
PROBE_TOKENS = 16
"""Tokens the server generates and both sides score."""
PROBE_SEED = 1234

TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.1}
"""Largest allowed |server - trainer| log-probability (nats) of any probe token, by served dtype.

float32, measured on CPU (hf engine against transformers, both fp32, the tiny model): 4.8e-7. The
bound 2e-3 leaves room for other CPUs, thread counts and BLAS builds while staying far below what
one optimizer step moves (the 2-step CPU run moves the probe by ~0.5). bfloat16: the server computes
in bf16 (8 mantissa bits, ~3 significant digits: a logit of 10 carries +-0.04) against an fp32
reference, with its own kernels (SGLang's attention and fused norms are not HF's); measured on an
H100 with the hf engine (made models: 4 layers x 512 and 12 x 1024): 1.5e-2 and 1.45e-2. Errors
grow with depth and with peaky logits, so the bound is 0.25, and `weights moved` requires the
update to move the probe by more than that (else a stale server would pass too).
float16 (3 more mantissa bits than bfloat16): not measured.
"""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


def timed(name: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    """Run one check; an exception is a failure whose detail is the error (the table still prints)."""
    started = time.monotonic()
    try:
        ok, detail = fn()
    except Exception as exc:  # a check that crashes is a failed check, reported in the table
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Check(name, ok, detail, time.monotonic() - started)


def check_stages(code: int, elapsed: float) -> Check:
    detail = "every stage finished" if code == 0 else f"launcher exit {code}: see the run's logs/"
    return Check("pipeline ran", code == 0, detail, elapsed)


def check_shards(paths: RunPaths, steps: int) -> Check:
    def run() -> tuple[bool, str]:
        from pipeline.run.shards import read_step

        rows = [read_step(paths, step, verify=True).num_rows for step in range(steps)]
        return True, f"{steps} steps, rows {rows}, manifests and sha256 verified"

    return timed("trajectory shards", run)


def check_checkpoints(paths: RunPaths, steps: int) -> Check:
    def run() -> tuple[bool, str]:
        complete = paths.complete_checkpoints()
        missing = [v for v in range(1, steps + 1) if v not in complete]
        if missing:
            return False, f"versions {missing} have no complete checkpoint under {paths.checkpoints}"
        last = paths.weights_dir(steps)
        files = sorted(p.name for p in last.glob("*.safetensors"))
        return bool(files), f"versions 1..{steps} complete; last: {last.name} ({', '.join(files) or 'no weights'})"

    return timed("checkpoints", run)


def check_served_version(url: str, paths: RunPaths, steps: int) -> Check:
    def run() -> tuple[bool, str]:
        from pipeline.engine.client import EngineClient
        from pipeline.run.weight_version import published_version

        async def served() -> int:
            async with EngineClient([url], health_interval_s=0) as client:
                return await client.weight_version()

        server, trainer = asyncio.run(served()), published_version(paths)
        ok = server == trainer == steps
        return ok, f"server {server}, trainer published {trainer}, expected {steps}"

    return timed("served version", run)


def check_publication(paths: RunPaths, weight_sync: str, *, want_nccl: bool) -> Check:
    """How the trainer published (the broadcast group's backend, from `weight_sync.json`) and how long it took."""

    def run() -> tuple[bool, str]:
        times = [float(r["time_publish_s"]) for r in read_jsonl(paths.train_metrics) if "time_publish_s" in r]
        spent = ", ".join(f"{t:.2f}s" for t in times) or "none recorded"
        if weight_sync == "disk":
            return not want_nccl, f"disk publication (NCCL not exercised), per step: {spent}"
        if not paths.weight_sync.exists():
            return False, f"trainer.weight_sync=nccl but no broadcast group was set up ({paths.weight_sync} absent)"
        backend = read_json(paths.weight_sync).get("backend")
        ok = backend == "nccl" or not want_nccl
        return ok and bool(times), f"{backend} broadcast, per step: {spent}" + ("" if ok else " (expected nccl)")

    return timed("weight publication", run)


def check_served_weights(
    url: str, checkpoint: Path, initial: Path, *, temperature: float, dtype: str, device: str = "cpu"
) -> list[Check]:
    """`served weights`: server vs checkpoint within `TOLERANCE[dtype]`; `weights moved`: the checkpoint
    differs from the initial model by more than that (else a stale server would pass too)."""
    tolerance = TOLERANCE[dtype]
    probe: dict[str, Any] = {}

    def served() -> tuple[bool, str]:
        prompt, output, server_lp = probe_server(url, checkpoint, temperature)
        trainer_lp = reference_logprobs(checkpoint, prompt, output, temperature, device)
        probe.update(prompt=prompt, output=output, trainer=trainer_lp)
        diff = max_abs_diff(server_lp, trainer_lp)
        return (
            diff <= tolerance,
            f"max |server - trainer| logprob {diff:.2e} over {len(output)} tokens (tolerance {tolerance:g}, {dtype})",
        )

    def moved() -> tuple[bool, str]:
        if not probe:
            return False, "no probe (the served-weights check failed to run)"
        before = reference_logprobs(initial, probe["prompt"], probe["output"], temperature, device)
        diff = max_abs_diff(before, probe["trainer"])
        return (
            diff > tolerance,
            f"max |last - initial| logprob {diff:.2e} (must exceed {tolerance:g}; raise trainer.optimizer.lr if not)",
        )

    return [timed("served weights", served), timed("weights moved", moved)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"probe lengths differ or are empty: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def probe_server(url: str, model_dir: Path, temperature: float) -> tuple[list[int], list[int], list[float]]:
    """The probe prompt's ids, and the tokens the server generated with their logprobs (`/generate`)."""
    from transformers import AutoTokenizer

    from pipeline.engine.client import EngineClient

    prompt = list(AutoTokenizer.from_pretrained(model_dir)(PROBE_TEXT)["input_ids"])
    params = {
        "max_new_tokens": PROBE_TOKENS,
        "temperature": temperature,
        "ignore_eos": True,
        "sampling_seed": PROBE_SEED,
    }

    async def generate() -> tuple[list[int], list[float]]:
        async with EngineClient([url], health_interval_s=0) as client:
            result = await client.generate(prompt, params)
        return result.output_ids, result.output_logprobs

    output, logprobs = asyncio.run(generate())
    return prompt, output, logprobs


def reference_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], temperature: float, device: str = "cpu"
) -> list[float]:
    """The trainer's log-probabilities of `output` after `prompt`: fp32, logits scaled as in training."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.losses import gather_logprobs, logit_scale

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() * logit_scale(temperature)
    values = gather_logprobs(logits, ids[0, len(prompt) :]).tolist()
    del model
    return [float(v) for v in values]
