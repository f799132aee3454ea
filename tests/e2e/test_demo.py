"""`arl demo` as a person runs it: arl installed from its wheel into a fresh venv (no repository anywhere on
its path: the demo's config, agent and data must come with the package), the CLI run as a subprocess with its
output piped (not a terminal), from an empty directory. It writes everything under that directory (`--out`),
prints absolute paths that exist, and shows one line per trained step while the run goes on; then `arl eval`,
`arl status` and `arl inspect` on the finished run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.demo.demo_run import MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
"""Enough for every line the demo prints (the task is learned over the shipped config's 150 steps; the
benchmark benchmarks/demo_learning.py checks that on three seeds)."""


def _env() -> dict[str, str]:
    """The test's environment less what a person's shell does not set. PYTHONDONTWRITEBYTECODE goes too: the fresh
    venv holds no bytecode (`fresh_venv_with`), and with it set every process of the demo compiled torch and
    transformers from source again (the demo's RL part took 23-25 s instead of 11-15 s)."""
    drop = ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TERM", "PYTHONPATH", "VIRTUAL_ENV")
    drop += ("PYTHONDONTWRITEBYTECODE",)
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_demo_piped(arl: list[str], cwd: Path, out: Path, *extra: str) -> tuple[list[str], float]:
    """Run the demo with its stdout piped; check every step line arrived before the run's end (the reward
    curve is drawn after the launcher exits). Returns the output lines and the wall time."""
    started = time.monotonic()
    proc = subprocess.Popen([*arl, "demo", "--steps", str(STEPS), *extra], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, early = [], []
    try:
        for raw in proc.stdout or []:
            line = raw.rstrip("\n")
            lines.append(line)
            if line.startswith("step "):
                early.append(proc.poll() is None and not list(out.glob("demo/*/reward_curve.png")))
        assert proc.wait(timeout=60) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    steps = [line for line in lines if re.match(r"step \d+: reward .* -> weight version \d+", line)]
    assert [s.split(":")[0] for s in steps] == [f"step {k}" for k in range(STEPS)], text
    assert all(f"-> weight version {k + 1}" in s for k, s in enumerate(steps)), text
    assert len(early) == STEPS and all(early), f"step lines came only at the end ({early}):\n{text}"
    return lines, time.monotonic() - started


def check_written_under(lines: list[str], cwd: Path, out: Path) -> Path:
    """Every path the demo printed is absolute, exists, and lies under `out`; `cwd` holds nothing else."""
    text = "\n".join(lines)
    (run_dir,) = re.findall(r"^run dir: (\S+)$", text, flags=re.M)
    (png,) = re.findall(r"^reward curve: (\S+)$", text, flags=re.M)
    (inspect,) = re.findall(r"^  arl inspect (\S+) --step (\d+) --decode$", text, flags=re.M)
    for path in (run_dir, png, inspect[0]):
        assert Path(path).is_absolute() and Path(path).exists() and Path(path).is_relative_to(out), (path, text)
    assert inspect == (run_dir, str(STEPS - 1))
    assert sorted(p.name for p in cwd.iterdir()) == [out.name], list(cwd.iterdir())
    assert (out / MODEL_NAME / "config.json").exists() and (out / MODEL_NAME / "warm_start.json").exists()
    assert len(list(Path(run_dir, "trajectories").glob("step_*"))) == STEPS
    check_final_lines(text)
    return Path(run_dir)


def check_final_lines(text: str) -> None:
    """The demo says it warm-started the model on the format only, and ends with the reward and the
    exact-correct rate (the task itself) of the first steps against the last, step 0 being before RL."""
    assert re.search(r"^warm start \(made\): \d+ supervised steps on demo_format.jsonl, the answer format only",
                     text, flags=re.M), text  # fmt: skip
    assert re.search(r"^mean reward,   step 0: \d\.\d{3}   step 1: \d\.\d{3}   change: ", text, flags=re.M), text
    assert re.search(r"^exact-correct, step 0: \d\.\d{3}   step 1: \d\.\d{3}   change: [-+]\d\.\d{3}   "
                     r"\(before RL, step 0: \d\.\d{3}\)$", text, flags=re.M), text  # fmt: skip
    assert "exact-correct per step" in text
    # the shipped config evaluates the held-out set during the run: version 0 (at_start) and the last version
    assert re.search(rf"^held-out evaluation repeat-greedy pass@1: version 0: \d\.\d{{3}}   version {STEPS}: "
                     r"\d\.\d{3}$", text, flags=re.M), text  # fmt: skip


def check_arl_eval(arl: list[str], run_dir: Path, cwd: Path) -> None:
    """`arl eval` on the finished run (which evaluated versions 0 and 2 itself): the demo's eval set on version 2
    with an engine of its own, written as
    shards `arl inspect` reads and a metrics line whose pass@1 is the share of exactly repeated numbers; a
    version or set that is not there is one line and exit 2, before any engine starts."""
    import json

    from pipeline.run.shards import read_step_dir

    done = subprocess.run([*arl, "eval", str(run_dir), "--step", str(STEPS), "--format", "json"], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = json.loads(done.stdout)
    assert (line["version"], line["set"], line["prompts"], line["runs"]) == (STEPS, "repeat-greedy", 90, 90)
    assert line["temperature"] == 0.0 and line["failed_runs"] == 0
    table, manifest = read_step_dir(run_dir / "eval" / f"step_{STEPS:06d}" / "repeat-greedy")
    assert table.num_rows == 90 and set(table.column("step").to_pylist()) == {STEPS}
    assert manifest.weight_versions is not None, "every sampled token was generated by the evaluated version"
    assert (manifest.weight_versions.min, manifest.weight_versions.max) == (STEPS, STEPS)
    exact = [json.loads(m)["metrics"]["exact_correct"] for m in table.column("metadata").to_pylist()]
    assert line["pass@1"] == sum(exact) / 90 == manifest.extra["pass@1"]
    *in_run, logged = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [(x["version"], x["weights"], x["runs"]) for x in in_run] == [
        (0, "engines at version 0", 90),
        (STEPS, f"engines at version {STEPS}", 90),
    ], "the run's own evaluations"
    assert logged["pass@1"] == line["pass@1"] and logged["step"] == STEPS and logged["weights"] == line["weights"]
    assert list((run_dir / "metrics" / "tb" / "eval").glob("events.out.tfevents.*")), "TensorBoard has the figures"
    status = subprocess.run([*arl, "status", str(run_dir)], cwd=cwd, env={**_env(), "COLUMNS": "200"},
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert f"version {STEPS}" in status.stdout and f"pass@1 {line['pass@1']:.3f}" in status.stdout, status.stdout
    shown = subprocess.run([*arl, "inspect", str(run_dir / "eval" / f"step_{STEPS:06d}" / "repeat-greedy")], cwd=cwd,
                           env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0 and "90" in shown.stdout, shown.stdout + shown.stderr
    unknown_set = "no evaluation set named 'nope' in the run's config; it has: repeat-greedy"
    for bad, says in ((["--step", "9"], "no complete checkpoint of version 9"), (["--set", "nope"], unknown_set)):
        refused = subprocess.run([*arl, "eval", str(run_dir), *bad], cwd=cwd, env=_env(), capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert refused.returncode == 2 and says in refused.stderr and len(refused.stderr.splitlines()) == 1, (
            refused.stderr
        )


def build_wheel(dest: Path) -> Path:
    """The wheel of the working tree as it is (tracked and new files), built from a copy so no build
    leftovers land in the checkout."""
    src = dest / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        origin, target = REPO / name, src / name
        if not origin.exists() and not origin.is_symlink():
            continue  # deleted in the work tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_symlink():
            target.symlink_to(os.readlink(origin))
        else:
            shutil.copy2(origin, target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dest / "dist"), str(src)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (dest / "dist").glob("arl-*.whl")
    return wheel


def fresh_venv_with(wheel: Path, venv: Path) -> Path:
    """A new venv with the CPU torch first (pinned: a resolver never swaps it for a CUDA build), then the
    wheel and all its dependencies, resolved as a user's `pip install` would. Faster, hiding nothing: this
    venv's pip drives the install (`--python`, so the new venv needs no pip of its own), pip's cache
    serves what was downloaded before, and no bytecode is compiled ahead (Python compiles on import)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile"]
    torch = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run([*pip, f"torch=={torch}"], check=True, capture_output=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch}\n")
    result = subprocess.run([*pip, "-c", str(constraints), str(wheel)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return venv / "bin" / "arl"


@pytest.mark.slow
def test_demo_installed_from_the_wheel_runs_in_an_empty_directory(tmp_path: Path) -> None:
    started = time.monotonic()
    arl = fresh_venv_with(build_wheel(tmp_path), tmp_path / "venv")
    installed_s = time.monotonic() - started
    where = subprocess.run([str(arl.parent / "python"), "-c", "import pipeline; print(pipeline.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert str(tmp_path / "venv") in where and str(REPO) not in where  # the installed package, not the checkout
    cwd = tmp_path / "empty"
    cwd.mkdir()
    lines, demo_s = run_demo_piped([str(arl)], cwd, cwd / "results", "--out", "results")
    run_dir = check_written_under(lines, cwd, cwd / "results")
    config = (run_dir / "config.yaml").read_text()
    assert str(tmp_path / "venv") in config and str(REPO) not in config  # agent and data from the package
    print(f"wheel built and installed in {installed_s:.0f}s; `arl demo --steps {STEPS}` took {demo_s:.0f}s")
    check_arl_eval([str(arl)], run_dir, cwd)
