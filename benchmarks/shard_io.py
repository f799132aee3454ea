"""Shard I/O throughput and size: arl's Parquet shards against AReaL-style JSONL, same data, same run.

Data: N samples of ~1,000 tokens (600–1,400), prompt share 20–70 %, token ids Zipf-distributed over
a 150k vocabulary (rank r has weight 1/r, ranks mapped to ids by a fixed permutation), sampled
log-probabilities float32 from a mix of confident (~-0.01) and uncertain (~-2) tokens, two weight
versions per step. Rows are Python lists, as a producer holds them.

Measured (wall clock, this process, files in a temp dir on the local disk):
* Parquet write: `pipeline.run.shards.write_step` (validate, convert, zstd, sha256, fsync, publish).
* Parquet read: `read_step` all columns (checksums verified) and `input_ids` + `loss_mask` only,
  into Arrow (what the trainer consumes: zero-copy to numpy/torch).
* JSONL write/read: one `json.dumps` object per sample per line / `json.loads` per line.

Usage: `python benchmarks/shard_io.py [--samples 20000] [--dir DIR]`. Prints a table, then one line
`RESULT {...}` (JSON) for the bench runner. Targets: read >= 10x faster than JSONL, size <= 1/3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

VOCAB = 150_000


def make_rows(samples: int, step: int = 5, seed: int = 0) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, VOCAB + 1)
    cdf = np.cumsum(weights / weights.sum())
    rank_to_id = rng.permutation(VOCAB)
    lengths = rng.integers(600, 1401, size=samples)
    tokens = rank_to_id[np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), VOCAB - 1)]
    rows, offset = [], 0
    now = datetime.now(UTC)
    for i, length in enumerate(lengths.tolist()):
        prompt = int(length * rng.uniform(0.2, 0.7))
        sampled = length - prompt
        confident = rng.random(sampled) < 0.8
        lp = np.where(confident, -rng.exponential(0.02, sampled), -rng.exponential(2.0, sampled)).astype(np.float32)
        version = step - 1 - int(rng.random() < 0.3)
        rows.append(
            {
                "step": step,
                "session_id": f"session-{i // 4:06d}",
                "sample_id": f"sample-{i:06d}",
                "parent_id": None,
                "group_id": f"group-{i // 16:05d}",
                "input_ids": tokens[offset : offset + length].tolist(),
                "loss_mask": [0] * prompt + [1] * sampled,
                "logprobs": [0.0] * prompt + lp.tolist(),
                "versions": [-1] * prompt + [version] * sampled,
                "reward": float(rng.random() < 0.4),
                "prompt_len": prompt,
                "num_turns": 1,
                "finish_reason": "stop" if rng.random() < 0.9 else "length",
                "created_at": now,
                "metadata": json.dumps({"index": i, "interaction_ids": [f"sample-{i:06d}"], "prefix_break": False}),
            }
        )
        offset += length
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    """AReaL-style dump: one JSON object per sample, lists as JSON arrays, fsynced like the shards."""
    import os

    with open(path, "w") as handle:
        for row in rows:
            obj = dict(row, created_at=int(row["created_at"].timestamp() * 1000))
            handle.write(json.dumps(obj) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: Path) -> int:
    tokens = 0
    with open(path) as handle:
        for line in handle:
            tokens += len(json.loads(line)["input_ids"])
    return tokens


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def run(samples: int, workdir: Path) -> dict[str, Any]:
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step, write_step
    from schemas.trajectory import rows_from_dicts

    rows = make_rows(samples)
    typed = rows_from_dicts(rows)  # what the rollout hands the writer; converted before the clock starts
    tokens = sum(len(r["input_ids"]) for r in rows)
    paths = RunPaths(workdir / "run")
    t_write, manifest = timed(write_step, paths, 5, typed, producer="bench", tokenizer="none")
    jsonl = workdir / "step.jsonl"
    t_jsonl_write, _ = timed(write_jsonl, rows, jsonl)
    del rows, typed
    t_read_all, table = timed(read_step, paths, 5)
    assert table.num_rows == samples
    del table
    t_read_two, table = timed(read_step, paths, 5, columns=["input_ids", "loss_mask"])
    del table
    t_jsonl_read, jsonl_tokens = timed(read_jsonl, jsonl)
    assert jsonl_tokens == tokens == manifest.totals.tokens
    parquet_bytes = sum((paths.step_dir(5) / p.file).stat().st_size for p in manifest.parts)
    jsonl_bytes = jsonl.stat().st_size
    return {
        "samples": samples,
        "tokens": tokens,
        "parts": len(manifest.parts),
        "parquet_write_tok_s": tokens / t_write,
        "parquet_read_all_tok_s": tokens / t_read_all,
        "parquet_read_ids_mask_tok_s": tokens / t_read_two,
        "parquet_bytes_per_token": parquet_bytes / tokens,
        "jsonl_write_tok_s": tokens / t_jsonl_write,
        "jsonl_read_tok_s": tokens / t_jsonl_read,
        "jsonl_bytes_per_token": jsonl_bytes / tokens,
        "read_speedup_all": t_jsonl_read / t_read_all,
        "read_speedup_ids_mask": t_jsonl_read / t_read_two,
        "write_speedup": t_jsonl_write / t_write,
        "size_ratio": parquet_bytes / jsonl_bytes,
        "parquet_mb": parquet_bytes / 2**20,
        "jsonl_mb": jsonl_bytes / 2**20,
    }


def report(result: dict[str, Any]) -> None:
    print(f"shard I/O: {result['samples']:,} samples, {result['tokens']:,} tokens, {result['parts']} parts")
    print(f"{'':24}{'parquet':>16}{'jsonl':>16}{'ratio':>10}")
    print(f"{'write tok/s':24}{result['parquet_write_tok_s']:>16,.0f}{result['jsonl_write_tok_s']:>16,.0f}"
          f"{result['write_speedup']:>9.1f}x")  # fmt: skip
    print(f"{'read tok/s (all cols)':24}{result['parquet_read_all_tok_s']:>16,.0f}{result['jsonl_read_tok_s']:>16,.0f}"
          f"{result['read_speedup_all']:>9.1f}x")  # fmt: skip
    print(f"{'read tok/s (ids+mask)':24}{result['parquet_read_ids_mask_tok_s']:>16,.0f}{'':>16}"
          f"{result['read_speedup_ids_mask']:>9.1f}x")  # fmt: skip
    print(f"{'bytes/token':24}{result['parquet_bytes_per_token']:>16.2f}{result['jsonl_bytes_per_token']:>16.2f}"
          f"{result['size_ratio']:>10.3f}")  # fmt: skip
    print(f"{'size MiB':24}{result['parquet_mb']:>16.1f}{result['jsonl_mb']:>16.1f}")
    ok_read = result["read_speedup_all"] >= 10
    ok_size = result["size_ratio"] <= 1 / 3
    verdict = {True: "met", False: "MISSED"}
    print(f"targets: read >= 10x JSONL: {verdict[ok_read]}; size <= 1/3: {verdict[ok_size]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="samples to write and read")
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir, removed after)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="arl-shard-bench-", dir=args.dir))
    try:
        result = run(args.samples, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(result)
    print("RESULT " + json.dumps({"name": "shard_io", **{k: round(v, 4) if isinstance(v, float) else v
                                                         for k, v in result.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
