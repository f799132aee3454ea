"""What `arl` prints when its output is not a terminal (a pipe, `tee`, a Slurm log), through the CLI as a subprocess.

* `arl launch --executor local` prints one line per trained step while the run goes on, not at its end (the
  stages are stand-ins that write the metrics rows a real run writes, so the test is fast and exact; the
  demo tests run the real pipeline).
* No command or path is hard-wrapped: the output of `arl launch --dry-run` and `arl status` piped is the
  same text as with an unlimited width.
* `arl status` fits 100 columns with every header whole, and drops columns, never cuts headers, when narrower.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from pipeline.run.config import dump_config, load_config
from pipeline.run.jobs import JobRecord, add_record
from pipeline.run.paths import RunPaths
from pipeline.run.progress import COLUMNS

REPO = Path(__file__).resolve().parents[2]
ARL = [sys.executable, "-m", "pipeline.cli"]
STEP_LINE = re.compile(r"^step (\d+): reward [\d.]+ \(std [\d.]+\)  length [\d.]+ tokens \([\d.]+ sampled\)  "
                       r"train [\d,]+ tokens/s  staleness [\d.]+  loss -?[\d.]+  -> weight version (\d+)$")  # fmt: skip

FAKE_STAGE = '''
"""Stand-in stage: the trainer writes the metrics rows of 3 steps, then waits for the test's go-ahead."""
import json, os, time
from pathlib import Path


def main(run_dir, step=None):
    stage = __name__.rsplit(".", 1)[-1]
    run = Path(run_dir)
    if stage != "train":
        while True:
            time.sleep(0.1)
    (run / "metrics").mkdir(exist_ok=True)
    for k in range(3):
        time.sleep(0.3)
        for name, row in (("rollout", {"reward_mean": 0.1 * k, "reward_std": 0.05, "sample_len_mean": 40.0 + k,
                                       "sampled_tokens": 48, "samples": 8}),
                          ("train", {"tokens_per_s": 1500.0, "staleness_mean": 0.5, "loss": -0.01, "version": k + 1})):
            with open(run / "metrics" / f"{name}.jsonl", "a") as handle:
                handle.write(json.dumps({"step": k, "time": time.time(), **row}) + "\\n")
    go = run / "go"
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return 0 if go.exists() else 5
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TERM")}
    return {**env, **extra}


def _workdir(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path]:
    """A work dir with the stand-in `stages` package (it shadows the real one: `python -m` puts the work dir
    first on sys.path) and a config with a real model, agent and dataset (`arl launch` checks them)."""
    work = tmp_path / ("deep-" + "d" * 60) / "work"
    (work / "stages").mkdir(parents=True)
    (work / "stages" / "__init__.py").write_text("")
    for name in ("inference", "rollout", "proxy", "train"):
        (work / "stages" / f"{name}.py").write_text(FAKE_STAGE)
    config = {"fileroot": str(work / "runs"), "experiment_name": "progress", "trial_name": "t", "num_steps": 3,
              "model": {"path": str(tiny_model_dir)},
              "rollout": {"agent": f"{REPO}/examples/demo_agent.py:DemoAgent",
                          "dataset": {"path": f"{REPO}/examples/data/demo.jsonl"}}}  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    return work, work / "runs" / "progress" / "t"


def test_local_launch_prints_each_step_while_the_run_goes_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    work, run = _workdir(tmp_path, tiny_model_dir)
    proc = subprocess.Popen([*ARL, "launch", "config.yaml", "--executor", "local"], cwd=work, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout or []), lines.put(None)], daemon=True).start()
    seen, still_running, deadline = [], [], time.monotonic() + 180
    try:
        while len(seen) < 3 and time.monotonic() < deadline:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, f"launch ended before its step lines: {seen}"
            if line.startswith("step "):
                seen.append(line.rstrip("\n"))
                still_running.append(proc.poll() is None and not (run / "go").exists())
        (run / "go").write_text("")  # the trainer may finish now
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(seen) == 3 and all(still_running), (seen, still_running)
    for k, line in enumerate(seen):
        match = STEP_LINE.match(line)
        assert match and match.groups() == (str(k), str(k + 1)), line


def _status_run(tmp_path: Path) -> RunPaths:
    """A run dir (deep, so its paths are longer than any console) with jobs and every column's metrics."""
    paths = RunPaths(tmp_path / ("deep-" + "r" * 70) / "exp" / "trial")
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(load_config(None)))
    for stage, code in (("inference", 0), ("rollout", 0), ("train", 0)):
        add_record(paths, JobRecord(stage=stage, attempt=1, executor="local", log=str(paths.stage_log(stage, 1)),
                                    host=socket.gethostname(), command="c", pid=1, exit_code=code))  # fmt: skip
    for step in range(8):
        paths.step_dir(step).mkdir(parents=True)
        paths.step_manifest(step).write_text("{}")
    paths.metrics.mkdir()
    paths.rollout_metrics.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10, "reward_std": 0.123,
                                     "sample_len_mean": 40.5, "sampled_tokens": 48, "samples": 8}) + "\n"
                                     for s in range(8)))  # fmt: skip
    paths.train_metrics.write_text("".join(json.dumps({"step": s, "loss": -0.0123, "tokens_per_s": 12345.6,
                                   "staleness_mean": 0.5, "version": s + 1}) + "\n" for s in range(8)))  # fmt: skip
    return paths


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]


def _header_cells(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("┃").split("┃")] for line in text.splitlines() if line[:1] == "┃"]


def test_status_fits_100_columns_and_drops_columns_when_narrower(tmp_path: Path) -> None:
    paths = _status_run(tmp_path)
    wide = subprocess.run([*ARL, "status", str(paths.root)], env=_env(COLUMNS="1000"), capture_output=True,
                          text=True, timeout=60, check=True).stdout  # fmt: skip
    jobs_headers = ["stage", "attempt", "job", "state", "detail"]
    step_headers = [c.header for c in COLUMNS if c.header != "exact"]  # this run's agents report no exact_correct
    for columns in ("100", None, "70", "40"):
        out = subprocess.run([*ARL, "status", str(paths.root)], env=_env(**({"COLUMNS": columns} if columns else {})),
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        width = int(columns or 100)  # piped without COLUMNS: 100
        assert all(len(row) <= width for row in _table_rows(out)), out
        jobs, steps = _header_cells(out)
        assert set(jobs) <= set(jobs_headers) and set(steps) <= set(step_headers), out  # whole headers only
        assert jobs[0] == "stage" and steps[0] == "step"
        if width == 100:
            assert jobs == jobs_headers and steps == step_headers, out
        else:
            assert len(steps) < len(step_headers), out
        # Everything but the tables is the text an unlimited width gives: no path or command is wrapped.
        assert _plain(out) == _plain(wide), out
        for stage in ("inference", "rollout", "train"):
            assert f"  {stage:<9} {paths.stage_log(stage, 1)}\n" in out


def _plain(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] not in "┏┃┡│└─"]


def test_dry_run_output_is_never_wrapped(tmp_path: Path, tiny_model_dir: Path) -> None:
    work, _ = _workdir(tmp_path, tiny_model_dir)
    outputs = {}
    for columns in (None, "1000"):
        env = _env(**({"COLUMNS": columns} if columns else {}))
        result = subprocess.run([*ARL, "launch", "config.yaml", "--dry-run"], cwd=work, capture_output=True,
                                text=True, timeout=120, env=env)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        outputs[columns] = result.stdout
    assert _plain(outputs[None]) == _plain(outputs["1000"])
    assert str(work) in outputs[None] and any(len(line) > 150 for line in _plain(outputs[None]))
    scripts = set(re.findall(r"(/[^\s`'\"]+\.sbatch)\b", outputs[None]))
    assert len(scripts) == 3 and all(Path(script).is_file() for script in scripts), scripts
