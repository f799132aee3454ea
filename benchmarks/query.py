"""`arl query` (DuckDB over the shards in place) against pandas reading the same Parquet files, same run.

Data: the step of `benchmarks/shard_io.py` (20,000 samples of ~1,000 tokens, 20M tokens, written by
`pipeline.run.shards.write_step` into a run dir in a temp dir on the local disk).

Measured (wall clock, best of `--repeat`, all in this process after the data is written):
* scan aggregate: per finish reason, samples, mean reward, tokens and sampled tokens: `SQL_SCAN` over
  `samples`. arl: `pipeline.analysis.query.connect` (every part's sha256 checked, the views made) + the query, what
  `arl query` does after its imports; also with `--no-verify`, and once as the CLI in a subprocess
  (interpreter start and imports included). pandas: `read_parquet` of the same part files (only the four
  columns the query needs), `len` and `sum` per row, `groupby`.
* tokens aggregate: sampled tokens and mean log-prob per weight version: `SQL_TOKENS` over `tokens`.
  pandas two ways: `explode` of the three list columns then `groupby` (what the pandas docs suggest), and
  a vectorised one (`numpy.concatenate` of the per-row arrays, then `bincount`), which a pandas user
  who knows numpy writes. The explode is timed once: it takes most of a minute.
Every arl result is checked against pandas' before anything is reported.

Usage: `python benchmarks/query.py [--samples 20000] [--repeat 3] [--dir DIR]`. Prints a table, then one
line `RESULT {...}` (JSON) for the bench runner.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/query.py`: the root, for `benchmarks.` imports
from benchmarks.shard_io import make_rows  # noqa: E402

STEP = 5
SQL_SCAN = ("SELECT finish_reason, count(*) AS samples, avg(reward) AS reward_mean, sum(n_tokens) AS tokens, "
            "sum(n_sampled) AS sampled FROM samples GROUP BY finish_reason ORDER BY finish_reason")  # fmt: skip
SQL_TOKENS = ("SELECT version, count(*) AS tokens, avg(logprob) AS logprob_mean FROM tokens WHERE loss_mask = 1 "
              "GROUP BY version ORDER BY version")  # fmt: skip


def best(repeat: int, fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return min(times), result


def arl(run: Path, sql: str, *, verify: bool = True) -> list[tuple[Any, ...]]:
    from pipeline.analysis.query import connect

    catalog = connect([run], verify=verify)
    try:
        return catalog.connection.sql(sql).fetchall()
    finally:
        catalog.connection.close()


def arl_cli(run: Path, sql: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "query", str(run), sql, "--format", "csv"],
                          capture_output=True, text=True, check=True, env=env, cwd=REPO)  # fmt: skip
    return proc.stdout


def pandas_scan(files: list[Path]) -> list[tuple[Any, ...]]:
    import numpy as np
    import pandas as pd

    df = pd.read_parquet(files, columns=["finish_reason", "reward", "input_ids", "loss_mask"])
    df["n_tokens"] = df["input_ids"].map(len)
    df["n_sampled"] = df["loss_mask"].map(np.sum)
    out = df.groupby("finish_reason").agg(samples=("reward", "size"), reward_mean=("reward", "mean"),
                                          tokens=("n_tokens", "sum"), sampled=("n_sampled", "sum"))  # fmt: skip
    return [(k, int(r.samples), float(r.reward_mean), int(r.tokens), int(r.sampled)) for k, r in out.iterrows()]


def pandas_tokens_explode(files: list[Path]) -> list[tuple[Any, ...]]:
    import pandas as pd

    df = pd.read_parquet(files, columns=["loss_mask", "logprobs", "versions"])
    tokens = df.explode(["loss_mask", "logprobs", "versions"])
    sampled = tokens[tokens["loss_mask"] == 1].astype({"versions": "int64", "logprobs": "float64"})
    out = sampled.groupby("versions")["logprobs"].agg(["count", "mean"])
    return [(int(v), int(r["count"]), float(r["mean"])) for v, r in out.iterrows()]


def pandas_tokens_numpy(files: list[Path]) -> list[tuple[Any, ...]]:
    import numpy as np
    import pandas as pd

    df = pd.read_parquet(files, columns=["loss_mask", "logprobs", "versions"])
    mask = np.concatenate(df["loss_mask"].to_numpy()) == 1
    versions = np.concatenate(df["versions"].to_numpy())[mask]
    logprobs = np.concatenate(df["logprobs"].to_numpy())[mask].astype(np.float64)
    counts = np.bincount(versions)
    sums = np.bincount(versions, weights=logprobs)
    return [(int(v), int(counts[v]), float(sums[v] / counts[v])) for v in np.flatnonzero(counts)]


def same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Equal rows; floats to 1e-6 relative (pandas averages float32 rewards in float32, DuckDB in double)."""
    import math

    def close(x: Any, y: Any) -> bool:
        return math.isclose(x, y, rel_tol=1e-6) if isinstance(x, float) or isinstance(y, float) else x == y

    return len(a) == len(b) and all(len(r) == len(s) and all(map(close, r, s)) for r, s in zip(a, b, strict=True))


def run(samples: int, repeat: int, workdir: Path) -> dict[str, Any]:
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import step_part_files, write_step
    from schemas.trajectory import rows_from_dicts

    paths = RunPaths(workdir / "run")
    manifest = write_step(paths, STEP, rows_from_dicts(make_rows(samples, step=STEP)), producer="bench",
                          tokenizer="none")  # fmt: skip
    files = step_part_files(paths.step_dir(STEP))[1]  # pandas reads exactly the files arl's views read
    arl(paths.root, "SELECT 1")  # DuckDB's first connection in a process loads its extensions: not a query's cost
    t_scan, scan = best(repeat, arl, paths.root, SQL_SCAN)
    t_scan_trust, scan_trust = best(repeat, arl, paths.root, SQL_SCAN, verify=False)
    t_cli, cli = best(1, arl_cli, paths.root, SQL_SCAN)
    t_pd_scan, pd_scan = best(repeat, pandas_scan, files)
    t_tokens, tokens = best(repeat, arl, paths.root, SQL_TOKENS)
    t_pd_numpy, pd_numpy = best(repeat, pandas_tokens_numpy, files)
    t_pd_explode, pd_explode = best(1, pandas_tokens_explode, files)
    assert same(scan, pd_scan) and same(scan_trust, pd_scan), (scan, pd_scan)
    assert len(cli.splitlines()) == len(scan) + 1
    assert same(tokens, pd_numpy) and same(tokens, pd_explode), (tokens, pd_numpy, pd_explode)
    return {
        "samples": samples,
        "tokens": manifest.totals.tokens,
        "parquet_mb": sum(p.stat().st_size for p in files) / 2**20,
        "scan_arl_s": t_scan,
        "scan_arl_no_verify_s": t_scan_trust,
        "scan_arl_cli_s": t_cli,
        "scan_pandas_s": t_pd_scan,
        "tokens_arl_s": t_tokens,
        "tokens_pandas_numpy_s": t_pd_numpy,
        "tokens_pandas_explode_s": t_pd_explode,
        "scan_speedup_vs_pandas": t_pd_scan / t_scan,
        "tokens_speedup_vs_pandas_numpy": t_pd_numpy / t_tokens,
        "tokens_speedup_vs_pandas_explode": t_pd_explode / t_tokens,
    }


def report(result: dict[str, Any]) -> None:
    print(f"arl query: {result['samples']:,} samples, {result['tokens']:,} tokens, {result['parquet_mb']:.1f} MiB")
    print(f"{'':34}{'seconds':>10}{'pandas / arl':>14}")
    rows = [
        ("scan: arl query (verified)", "scan_arl_s", "scan_speedup_vs_pandas"),
        ("scan: arl query --no-verify", "scan_arl_no_verify_s", None),
        ("scan: arl query CLI (subprocess)", "scan_arl_cli_s", None),
        ("scan: pandas", "scan_pandas_s", None),
        ("tokens: arl query (verified)", "tokens_arl_s", None),
        ("tokens: pandas + numpy", "tokens_pandas_numpy_s", "tokens_speedup_vs_pandas_numpy"),
        ("tokens: pandas explode", "tokens_pandas_explode_s", "tokens_speedup_vs_pandas_explode"),
    ]
    for label, key, ratio in rows:
        print(f"{label:34}{result[key]:>10.2f}" + (f"{result[ratio]:>13.1f}x" if ratio else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="samples in the step")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (the best counts)")
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir, removed after)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="arl-query-bench-", dir=args.dir))
    try:
        result = run(args.samples, args.repeat, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(result)
    ratios = {k: round(v, 2) for k, v in result.items() if "speedup" in k}
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k not in ratios}
    print("RESULT " + json.dumps({"name": "query", "figures": figures, "ratios": ratios,
                                  "reference": "pandas reading the same Parquet files in the same run"}))  # fmt: skip


if __name__ == "__main__":
    main()
