"""`arl status` on a run dir written by hand: progress, recent metrics, a dead stage with its log."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from rich.console import Console

from pipeline.launch.status import show_status, stop_run
from pipeline.run.config import dump_config, load_config
from pipeline.run.jobs import JobRecord, add_record
from pipeline.run.paths import RunPaths


def _run(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(dump_config(load_config(None)))
    return paths


def test_status_shows_progress_and_the_last_steps_metrics(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    for step in range(7):
        paths.step_dir(step).mkdir(parents=True)
        paths.step_manifest(step).write_text("{}")
    paths.state.mkdir()
    paths.weight_version.write_text(json.dumps({"version": 6}))
    paths.metrics.mkdir()
    paths.rollout_metrics.write_text("".join(
        json.dumps({"step": s, "reward_mean": s / 10, "sample_len_mean": 40 + s, "samples": 8}) + "\n"
        for s in range(7)))  # fmt: skip
    paths.train_metrics.write_text(json.dumps({"step": 6, "loss": 0.125}) + "\n")
    console = Console(record=True, width=200)
    assert show_status(paths.root, console=console) == 0
    text = console.export_text()
    assert "newest complete step: 6 (7 complete)" in text and "weight version: 6 (steps 0-5 trained)" in text
    table = text[text.index("last 5 steps") :]
    assert "reward" in table and "length" in table and "loss" in table and "version" in table
    assert "0.600" in table and "0.1250" in table
    assert " 42.0 " in table and " 41.0 " not in table  # sample_len_mean of steps 2..6 only
    assert "│       7 │" in table  # step 6 was trained into weight version 7
    assert "no jobs recorded" in text


def test_status_names_a_dead_stage_and_its_log_and_stop_skips_it(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    log = paths.stage_log("rollout", 2)
    add_record(paths, JobRecord(stage="rollout", attempt=2, executor="local", log=str(log),
                                host=socket.gethostname(), command="c", pid=1, exit_code=7))  # fmt: skip
    console = Console(record=True, width=200)
    assert show_status(paths.root, console=console) == 1
    text = console.export_text()
    host = socket.gethostname()
    assert f"stage rollout died: pid 1 on {host} (attempt 2) ended EXITED; exit 7; its log: {log}" in text
    assert "what to do: read the end of its log, fix the cause, then `arl launch CONFIG --resume`" in text
    console = Console(record=True, width=200)
    assert stop_run(paths.root, console=console) == 0
    assert "nothing to stop" in console.export_text()
