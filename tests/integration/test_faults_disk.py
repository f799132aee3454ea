"""A full disk, a file-size limit and a read-only run dir: the stage fails with an error naming the
path, nothing half-written is ever visible, and a rerun once there is room completes the step once.

Three ways to run out of room, all real: a 1-2 MiB `tmpfs` mounted for the test (needs root; skipped
otherwise), `RLIMIT_FSIZE` set in the stage's subprocess (works for any user: writes past the limit
fail with EFBIG), and a read-only run dir (a tmpfs remounted read-only as root, `chmod` otherwise).
The stages are real `arl stage train` subprocesses; shards are written by `pipeline.run.shards.write_step`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.run.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
TRAIN_OVERRIDES = ["num_steps=1", "trainer.wait_timeout_s=5", "trainer.publish_timeout_s=10"]


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real small file system at `path` (root only); unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the RLIMIT_FSIZE tests cover a full disk without it")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: files may not grow past `limit` bytes; EFBIG instead of the default SIGXFSZ kill."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def train(paths: RunPaths, preexec: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(paths.root)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=preexec)  # fmt: skip


def published_view_problems(paths: RunPaths) -> list[str]:
    """Everything a reader would find wrong: a complete step that fails verification, a complete
    checkpoint that does not load, LATEST naming an incomplete checkpoint, a step dir without marker."""
    from safetensors.torch import load_file

    from pipeline.run.shards import read_step

    problems = []
    for step in paths.complete_steps():
        try:
            read_step(paths, step)
        except Exception as exc:
            problems.append(f"step {step}: {exc}")
    for version in paths.complete_checkpoints():
        directory = paths.checkpoint_dir(version)
        try:
            load_file(str(directory / "model.safetensors"))
            (directory / "config.json").read_text()
        except Exception as exc:
            problems.append(f"checkpoint {version}: {exc}")
    if paths.latest.exists() and int(paths.latest.read_text()) not in paths.complete_checkpoints():
        problems.append(f"LATEST names {paths.latest.read_text().strip()}, which is not complete")
    for parent, marker in ((paths.trajectories, "_MANIFEST.json"), (paths.checkpoints, "_COMPLETE")):
        if parent.exists():
            problems += [f"{p} has no {marker}" for p in parent.iterdir()
                         if p.is_dir() and not p.name.endswith(".tmp") and not (p / marker).exists()]  # fmt: skip
    return problems


def assert_failed_naming(done: subprocess.CompletedProcess[str], root: Path, reason: str) -> None:
    assert done.returncode != 0, done.stderr[-2000:]
    tail = done.stderr[-3000:]
    assert reason in tail, tail
    assert str(root) in tail, f"the error does not name a path under {root}:\n{tail}"


def assert_trained_once(paths: RunPaths) -> None:
    from pipeline.run.sinks import read_jsonl

    assert paths.checkpoint_marker(1).exists()
    assert [r["step"] for r in read_jsonl(paths.train_metrics)] == [0], "step 0 trained (and logged) exactly once"
    assert published_view_problems(paths) == []


@pytest.fixture(scope="module")
def fsize_failures(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One trainer run and one shard write past a file-size limit (shared: each costs a subprocess)."""
    from pipeline.run.config import dump_config, load_config
    from pipeline.run.handoff import write_text_atomic
    from pipeline.run.shards import write_step
    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows
    from schemas.trajectory import rows_from_dicts

    root = tmp_path_factory.mktemp("fsize")
    config = load_config(None, [f"fileroot={root}", "experiment_name=x", "trial_name=train",
                                f"model.path={tiny_model_dir}", "trainer.device=cpu", *TRAIN_OVERRIDES])  # fmt: skip
    train_paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    write_text_atomic(train_paths.config, dump_config(config))
    rows = rows_from_dicts(add_behaviour_logprobs(synthetic_rows(0), tiny_model_dir))
    write_step(train_paths, 0, rows, producer="rollout", tokenizer=str(tiny_model_dir))
    trained = train(train_paths, file_size_limit(512 * 1024))  # the tiny checkpoint is ~1.6 MB
    shard_paths = RunPaths(root / "shards")
    script = WRITE_STEP.format(tests=str(REPO / "tests"), root=str(shard_paths.root))
    written = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                             preexec_fn=file_size_limit(64 * 1024))  # fmt: skip
    return {"train": (train_paths, trained), "shards": (shard_paths, written, script)}


def test_trainer_past_a_file_size_limit_fails_cleanly_then_resumes(fsize_failures: dict[str, Any]) -> None:
    paths, done = fsize_failures["train"]
    assert done.returncode != 0, done.stderr[-2000:]
    assert not paths.checkpoint_marker(1).exists()
    assert published_view_problems(paths) == []
    resumed = train(paths)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_trained_once(paths)


def test_shards_past_a_file_size_limit_are_never_visible(fsize_failures: dict[str, Any]) -> None:
    paths, done, script = fsize_failures["shards"]
    assert done.returncode != 0 and "published" not in done.stdout
    assert "File too large" in done.stderr, done.stderr[-2000:]
    assert paths.complete_steps() == []
    assert published_view_problems(paths) == []
    again = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert paths.complete_steps() == [0] and published_view_problems(paths) == []


def test_trainer_disk_error_names_the_path_and_the_cause(fsize_failures: dict[str, Any]) -> None:
    paths, done = fsize_failures["train"]
    assert_failed_naming(done, paths.root, "File too large")


def test_shard_disk_error_names_the_path(fsize_failures: dict[str, Any]) -> None:
    paths, done, _ = fsize_failures["shards"]
    assert_failed_naming(done, paths.trajectories, "File too large")


def test_trainer_on_a_full_disk_fails_cleanly_then_resumes(make_train_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = make_train_run(steps=[0], overrides=TRAIN_OVERRIDES)
    with tmpfs(tmp_path / "disk", "2m") as disk:
        paths = RunPaths(disk / "run")
        shutil.copytree(source.root, paths.root)
        done = train(paths)
        assert done.returncode != 0, done.stderr[-2000:]
        assert not paths.checkpoint_marker(1).exists()
        assert published_view_problems(paths) == []
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = train(paths)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_trained_once(paths)


WRITE_STEP = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from unit.test_shards import make_rows
from pipeline.run.paths import RunPaths
from pipeline.run.shards import write_step
rows = make_rows(400, step=0, prompt=300, sampled=300, seed=1)
write_step(RunPaths(Path({root!r})), 0, rows, producer="rollout", tokenizer="t", rows_per_part=50)
print("published")
"""


@contextlib.contextmanager
def read_only_copy(source: Path, where: Path) -> Iterator[Path]:
    """`source` copied to a directory nobody (root included) can write to."""
    if os.geteuid() == 0:
        with tmpfs(where, "8m") as disk:
            shutil.copytree(source, disk / source.name)
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            yield disk / source.name
        return
    copy = where / source.name
    shutil.copytree(source, copy)
    for directory, _, _ in os.walk(copy):
        os.chmod(directory, 0o555)
    try:
        yield copy
    finally:
        for directory, _, _ in os.walk(copy):
            os.chmod(directory, 0o755)


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def test_read_only_run_dir_fails_naming_the_path_and_changes_nothing(make_train_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = make_train_run(steps=[0], overrides=TRAIN_OVERRIDES, name=f"ro{uuid.uuid4().hex[:4]}")
    with read_only_copy(source.root, tmp_path / "ro") as root:
        before = listing(root)
        done = train(RunPaths(root))
        assert done.returncode != 0
        tail = done.stderr[-3000:]
        assert "Read-only file system" in tail or "Permission denied" in tail, tail
        assert str(root) in tail, tail
        assert listing(root) == before
