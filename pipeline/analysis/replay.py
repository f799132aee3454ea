"""`arl replay RUN --step K`: the engine's recorded log-probabilities of a step against the trainer's own.

Every sampled token of step K is scored again with the trainer's forward path (`TorchBackend.logprobs`: the
same packing, temperature scaling by 1 / `rollout.temperature` and LoRA wrapping as the loss's proximal
pass) under the weights that sampled it: tokens are grouped by the version recorded with each of them, and
version v is checkpoint v (0: `model.path`; a LoRA run's checkpoint is its adapter on the base). With
`--checkpoint` every token is scored under that one model instead. Each token becomes one flat row of a
Parquet file (`REPLAY_COLUMNS`, readable by `arl query` / DuckDB as it is); the summary is mean / max
|delta|, the k3 estimate of KL(engine || trainer) and the worst tokens decoded in context.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import ArlError
from pipeline.run.paths import RunPaths, is_adapter_dir
from pipeline.trainer.data import COLUMNS, Sample, rows_to_samples
from schemas.config import ArlConfig

log = logging.getLogger("arl.replay")

REPLAY_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("step", pa.int64()),
        ("sample_id", pa.string()),
        ("pos", pa.int64()),
        ("token_id", pa.int64()),
        ("version", pa.int64()),
        ("checkpoint", pa.string()),
        ("engine_logprob", pa.float64()),
        ("trainer_logprob", pa.float64()),
        ("delta", pa.float64()),
    ]
)
"""One row per sampled token: `pos` its index in the sample's `input_ids`, `version` the weights that sampled
it, `checkpoint` the weights it was replayed under, `delta` = trainer_logprob - engine_logprob."""
CONTEXT_TOKENS = 8
"""Tokens of context decoded before each of the worst tokens."""


@dataclass
class Replay:
    run: str
    step: int
    table: pa.Table
    checkpoints: dict[str, list[int]]
    """Weights replayed under -> the versions whose tokens they scored."""
    summary: dict[str, float] = field(default_factory=dict)
    worst: list[dict[str, Any]] = field(default_factory=list)


def replay_step(
    run_dir: Path, step: int, *, checkpoint: Path | None = None, device: str = "cpu", worst: int = 10
) -> Replay:
    """Score step `step`'s sampled tokens again (see the module docstring); nothing is written."""
    from pipeline.run.config import config_from_run_dir
    from pipeline.run.shards import read_manifest, read_step

    if device not in ("cpu", "cuda", "auto"):
        raise ArlError(f"--device must be cpu, cuda or auto, got {device!r}")
    paths = RunPaths(Path(run_dir))
    config = config_from_run_dir(run_dir)
    config.trainer.device = device  # type: ignore[assignment]  # checked above
    config.trainer.algorithm.kl_coef = 0.0  # no reference model: only the policy's log-probs are needed
    if not paths.step_manifest(step).exists():
        raise ArlError(f"{paths.step_dir(step)} is not a complete step; complete steps: {paths.complete_steps()}")
    samples = [s for s in rows_to_samples(read_step(paths, step, columns=COLUMNS).to_pylist()) if s.trained_tokens]
    groups = _weights_by_version(paths, config, samples, step, checkpoint)
    rows: list[dict[str, Any]] = []
    run = f"{config.experiment_name}/{config.trial_name}"
    for weights, versions in groups.items():
        rows += _score(config, Path(weights), samples, None if checkpoint else set(versions), run, step)
    table = pa.Table.from_pylist(rows, schema=REPLAY_SCHEMA)
    result = Replay(run, step, table, {str(k): v for k, v in groups.items()}, summarize(table))
    tokenizer = config.model.tokenizer or read_manifest(paths, step).tokenizer or config.model.path
    result.worst = worst_tokens(table, {s.sample_id: s for s in samples}, worst, tokenizer)
    return result


def _weights_by_version(
    paths: RunPaths, config: ArlConfig, samples: list[Sample], step: int, checkpoint: Path | None
) -> dict[str, list[int]]:
    """Which weights score which versions' tokens: `checkpoint` for all, else each version's own checkpoint."""
    versions = sorted({int(v) for s in samples for v in s.versions[1:][s.loss_mask[1:] == 1]})
    if checkpoint is not None:
        if not checkpoint.is_dir():
            raise ArlError(f"--checkpoint {checkpoint} is not a directory (a Hugging Face model or a LoRA adapter)")
        if is_adapter_dir(checkpoint) and config.trainer.lora is None:
            raise ArlError(
                f"--checkpoint {checkpoint} is a LoRA adapter but the run trains full weights; pass a full "
                "model (e.g. the adapter's merged/ directory or `arl export-merged`'s output)"
            )
        return {str(checkpoint): versions}
    kept = paths.complete_checkpoints()
    missing = [v for v in versions if v > 0 and v not in kept]
    if missing:
        raise ArlError(
            f"step {step} was sampled by versions {versions}; checkpoints of {missing} are gone (pruned by "
            f"trainer.keep_checkpoints={config.trainer.keep_checkpoints}, or never written with "
            f"trainer.checkpoint_every={config.trainer.checkpoint_every}), kept: {kept}; pass --checkpoint PATH"
        )
    return {str(Path(config.model.path) if v == 0 else paths.checkpoint_dir(v)): [v] for v in versions}


def _score(
    config: ArlConfig, weights: Path, samples: list[Sample], versions: set[int] | None, run: str, step: int
) -> list[dict[str, Any]]:
    """Rows of the sampled tokens (of `versions`, or all) scored with the trainer's backend loaded from `weights`."""
    from pipeline.trainer.packing import plan_step
    from pipeline.trainer.torch_backend import TorchBackend

    chosen = [s for s in samples if versions is None or versions & set(s.versions[s.loss_mask == 1].tolist())]
    if not chosen:
        return []
    backend = TorchBackend(config, total_updates=1)
    rows = []
    try:
        backend.load(weights, None)
        log.info("scoring %d samples under %s", len(chosen), weights)
        plan = plan_step(
            chosen,
            np.zeros(len(chosen)),
            minibatches=1,
            budget=config.trainer.micro_batch_tokens,
            agg="token",
            seed=0,
            step=step,
            layout=backend.layout,
        )
        for micro in plan[0]:
            logp = backend.logprobs(micro).numpy()
            width = len(logp) // len(micro.lengths) if backend.layout == "padded" else 0
            start = 0
            for i, n in zip(micro.sample_index, micro.lengths, strict=True):
                rows += _rows(chosen[i], logp[start : start + n - 1], versions, run, step, str(weights))
                start += width or n
    finally:
        backend.close()
    return rows


def _rows(
    sample: Sample, logp: np.ndarray, versions: set[int] | None, run: str, step: int, checkpoint: str
) -> list[dict[str, Any]]:
    """`logp[p]` is the trainer's log-prob of token p + 1 (the packer's shift)."""
    out = []
    for pos in np.flatnonzero(sample.loss_mask[1:] == 1) + 1:
        version = int(sample.versions[pos])
        if versions is not None and version not in versions:
            continue
        engine, trainer = float(sample.logprobs[pos]), float(logp[pos - 1])
        out.append(
            {
                "run": run,
                "step": step,
                "sample_id": sample.sample_id,
                "pos": int(pos),
                "token_id": int(sample.input_ids[pos]),
                "version": version,
                "checkpoint": checkpoint,
                "engine_logprob": engine,
                "trainer_logprob": trainer,
                "delta": trainer - engine,
            }
        )
    return out


def summarize(table: pa.Table) -> dict[str, float]:
    """Token count, mean / max |delta|, mean delta and the k3 estimate of KL(engine || trainer) over the tokens."""
    delta = table.column("delta").to_numpy()
    if not delta.size:
        return {"tokens": 0}
    return {
        "tokens": int(delta.size),
        "samples": len(set(table.column("sample_id").to_pylist())),
        "mean_abs_delta": float(np.abs(delta).mean()),
        "max_abs_delta": float(np.abs(delta).max()),
        "mean_delta": float(delta.mean()),
        "kl_k3": float(np.mean(np.exp(delta) - 1.0 - delta)),
    }


def worst_tokens(table: pa.Table, samples: dict[str, Sample], count: int, tokenizer: str) -> list[dict[str, Any]]:
    """The `count` tokens of largest |delta|, each with the text of the token and of the tokens before it."""
    if not count or not table.num_rows:
        return []
    decode = _decoder(tokenizer)
    delta = table.column("delta").to_numpy()
    out = []
    for row in np.argsort(-np.abs(delta), kind="stable")[:count]:
        r = table.slice(int(row), 1).to_pylist()[0]
        ids = samples[r["sample_id"]].input_ids
        pos = r["pos"]
        out.append({**r, "token": decode([ids[pos]]), "context": decode(ids[max(0, pos - CONTEXT_TOKENS) : pos])})
    return out


def _decoder(tokenizer: str) -> Any:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as exc:  # a tokenizer that moved away: show the ids
        log.warning("cannot load tokenizer %s (%s): showing token ids", tokenizer, exc)
        return lambda ids: " ".join(str(int(i)) for i in ids)
    return lambda ids: tok.decode([int(i) for i in ids])


def write_parquet(table: pa.Table, path: Path) -> Path:
    """Publish the per-token table atomically (readers never see a torn file)."""
    import pyarrow.parquet as pq

    from pipeline.run.handoff import write_bytes_atomic

    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return write_bytes_atomic(path, buffer.getvalue())


def replay_command(
    run_dir: Path, step: int, *, checkpoint: Path | None, device: str, output: Path | None, fmt: str, worst: int
) -> int:
    """`arl replay`: replay, write the Parquet, print the report (a table for people or JSON)."""
    result = replay_step(run_dir, step, checkpoint=checkpoint, device=device, worst=worst)
    written = write_parquet(result.table, output or RunPaths(Path(run_dir)).replay_file(step))
    if fmt == "json":
        print(
            json.dumps(
                {
                    "run": result.run,
                    "step": step,
                    "output": str(written),
                    "checkpoints": result.checkpoints,
                    **result.summary,
                    "worst": result.worst,
                },
                default=str,
            )
        )
    else:
        _print_report(result, written)
    return 0


def _print_report(result: Replay, written: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    from pipeline.run.console import people_console

    console = people_console()
    s = result.summary
    for weights, versions in result.checkpoints.items():
        console.print(f"versions {versions} scored under {escape(weights)}")
    if not s.get("tokens"):
        console.print(f"step {result.step}: no sampled tokens to replay")
    else:
        console.print(
            f"step {result.step}: {s['tokens']} tokens of {s['samples']} samples: "
            f"mean |Δ| {s['mean_abs_delta']:.3g}, max |Δ| {s['max_abs_delta']:.3g}, "
            f"mean Δ {s['mean_delta']:.3g}, KL k3 {s['kl_k3']:.3g}"
        )
    if result.worst:
        table = Table(title="largest |Δ| (Δ = trainer - engine log-prob)")
        for name in ("sample", "pos", "version", "engine", "trainer", "Δ", "context ⟶ token"):
            table.add_column(name, overflow="fold")
        for w in result.worst:
            table.add_row(
                escape(w["sample_id"]),
                str(w["pos"]),
                str(w["version"]),
                f"{w['engine_logprob']:.4f}",
                f"{w['trainer_logprob']:.4f}",
                f"{w['delta']:+.4f}",
                f"{escape(repr(w['context']))} ⟶ [bold]{escape(repr(w['token']))}[/bold]",
            )
        console.print(table)
    console.print(f"per-token rows: {written}")
