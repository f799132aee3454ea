"""Mistakes caught before anything is written or submitted: `arl check` and `arl launch` as subprocesses.

Each broken config (model, agent, dataset, a Slurm request the local cluster cannot meet) exits 2 with
one line per problem naming the key, the value and the fix, and leaves no run dir. A dry run writes
only under `--out`; a submission Slurm refuses half-way cancels what it queued and leaves nothing.
Scripts whose interpreter comes from `cluster.python` and a `setup` line run under plain sbatch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
AGENT = f"{REPO}/examples/demo_agent.py:DemoAgent"
DATA = f"{REPO}/examples/data/demo.jsonl"
NEEDS_FIELDS = """
class FieldAgent:
    required_fields = ("question", "answer")

    async def run(self, data, **kwargs):
        return 0.0
"""


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    probe = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=30)
    return probe.returncode == 0 and "up" in probe.stdout


slurm = pytest.mark.skipif(not _slurm_up(), reason="local Slurm cluster is down (scripts/local_slurm.sh up)")


@pytest.fixture
def workdir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    config = {"fileroot": str(tmp_path / "runs"), "experiment_name": "chk", "trial_name": "t", "num_steps": 2,
              "model": {"path": str(tiny_model_dir)},
              "rollout": {"agent": AGENT, "dataset": {"path": DATA}},
              "eval": {"at_start": True, "sets": [{"name": "held", "path": DATA, "max_concurrency": 4}]}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def arl(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=workdir, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=300)  # fmt: skip


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error: ")]


def test_a_good_config_passes_every_check(workdir: Path) -> None:
    result = arl(workdir, "check", "config.yaml", "--executor", "local")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("model and tokenizer", "chat template", "agent and dataset", "eval sets", "inference engine",
                 "file root"):  # fmt: skip
        assert name in result.stdout
    assert "token-exact over two turns" in result.stdout and "no problems found" in result.stdout


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.path=/nonexistent/model", "model.path='/nonexistent/model': no such directory"),
        ("model.max_context=4096", "model.max_context=4096: the checkpoint has 2048 positions"),
        ("rollout.agent=/nonexistent/agent.py:Agent", "rollout.agent='/nonexistent/agent.py:Agent':"),
        ("rollout.agent=json:dumps", "rollout.agent='json:dumps':"),
        ("rollout.dataset.path=/nonexistent/data.jsonl", "rollout.dataset.path='/nonexistent/data.jsonl':"),
        (
            "eval.sets=[{name: held, path: /nonexistent/held.jsonl, max_concurrency: 4}]",
            "eval.sets[0].path='/nonexistent/held.jsonl':",
        ),
        ("inference.backend=sglang", "inference.backend='sglang':"),
    ],
)
def test_a_broken_config_is_refused_before_anything_is_written(workdir: Path, override: str, key: str) -> None:
    for mode in (["--dry-run"], ["--executor", "local"]):
        if override.startswith("inference.backend") and mode == ["--dry-run"]:
            continue  # a Slurm dry run does not start the engine here: nothing to check on this machine
        result = arl(workdir, "launch", "config.yaml", override, *mode)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = errors(result)
        assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), result.stderr
        assert not (workdir / "runs").exists() and not (workdir / "arl-dry-run").exists()


def test_rows_lacking_the_agents_required_fields_are_refused(workdir: Path) -> None:
    (workdir / "field_agent.py").write_text(NEEDS_FIELDS)
    (workdir / "rows.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n" +
                                        json.dumps({"question": "q2"}) + "\n")  # fmt: skip
    result = arl(workdir, "check", "config.yaml", "rollout.agent=field_agent.py:FieldAgent",
                 "rollout.dataset.path=rows.jsonl", "--executor", "local")  # fmt: skip
    assert result.returncode == 2
    # the eval set keeps the demo's prompts and, naming no agent, gets the training agent: checked the same way
    assert errors(result) == ["error: rollout.dataset.path='rows.jsonl': row 1 lacks answer, which the agent "
                              "requires (its required_fields)",
                              f"error: eval.sets[0].path='{DATA}': row 0 lacks question, answer, which the agent "
                              "requires (its required_fields)"]  # fmt: skip


def test_a_dry_run_writes_only_under_out(workdir: Path) -> None:
    out = workdir / "scripts"
    result = arl(workdir, "launch", "config.yaml", "--dry-run", "--out", str(out), "fileroot=/dev/shm/arl-dry-test")
    assert result.returncode == 0, result.stdout + result.stderr
    written = sorted(p.name for p in out.iterdir())
    assert written == ["config.yaml", "inference.sbatch", "rollout.sbatch", "train.sbatch"]
    assert not Path("/dev/shm/arl-dry-test").exists() and not (workdir / "runs").exists()
    flat = " ".join(result.stdout.split())
    assert "nothing written under fileroot" in flat and "--prepare instead of --dry-run" in flat
    # this launch's interpreter is not on /dev/shm's file system: the user is told the nodes may not see it
    assert "warning: the jobs will run" in flat and "set cluster.python" in flat


@pytest.mark.slurm
@slurm
def test_slurm_requests_the_cluster_cannot_meet_are_refused(workdir: Path) -> None:
    result = arl(workdir, "launch", "config.yaml", "cluster.train.partition=gpu-nope",
                 "cluster.inference.gpus_per_node=4", "cluster.rollout.nodelist=node77", "proxy.workers=2",
                 "rollout.agent_transport=http")  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = errors(result)
    assert len(lines) == 4, lines
    assert any(line.startswith("error: cluster.rollout.cpus_per_task=1: fewer CPUs than proxy.workers=2")
               for line in lines)  # fmt: skip
    assert any(line.startswith("error: cluster.train.partition='gpu-nope': no such partition") for line in lines)
    assert any(line.startswith("error: cluster.inference.gpus_per_node=4: no node of partition") for line in lines)
    assert any(line.startswith("error: cluster.rollout.nodelist='node77': node77 not in partition") for line in lines)
    assert not (workdir / "runs").exists()


@pytest.mark.slurm
@slurm
def test_a_submission_refused_half_way_leaves_nothing_behind(workdir: Path) -> None:
    """Slurm accepts two jobs, then refuses the trainer (a reservation that does not exist): both are cancelled
    and the run dir this launch created is gone, so the same command, fixed, can simply be run again."""
    result = arl(workdir, "launch", "config.yaml", "cluster.train.extra_sbatch=['--reservation=arl-no-such']")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = errors(result)
    assert "sbatch refused the train job" in line and "cancelled inference (job" in line and "rollout (job" in line
    assert "removed the run dir" in line
    assert not (workdir / "runs" / "chk" / "t").exists()
    jobs = [word.rstrip("),;") for word in line.split() if word.rstrip("),;").isdigit()]
    queued = subprocess.run(["squeue", "-h", "-j", ",".join(jobs)], capture_output=True, text=True).stdout
    assert not queued.strip(), queued


@pytest.mark.slurm
@slurm
def test_a_venv_activated_only_by_setup_runs_the_stage_under_plain_sbatch(workdir: Path) -> None:
    """`cluster.python: python` + a setup line: the script names no interpreter of the launcher's; submitted
    from an environment without the venv, and with `--export=NONE`, the job finds python through the venv its
    setup line activates."""
    setup = f"cluster.setup=['source {REPO}/.venv/bin/activate']"
    prepared = arl(workdir, "launch", "config.yaml", "--prepare", "cluster.python=python", setup,
                   f"cluster.workdir={workdir}")  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    run_dir = workdir / "runs" / "chk" / "t"
    script = (run_dir / "sbatch" / "inference.sbatch").read_text()
    assert sys.executable not in script.replace(f"source {REPO}/.venv/bin/activate", "")
    assert f"--chdir={workdir}" in script and "python -m pipeline.cli stage inference" in script
    bare = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    script_path = str(run_dir / "sbatch" / "inference.sbatch")
    job = subprocess.run(["sbatch", "--parsable", "--export=NONE", script_path], cwd="/", capture_output=True,
                         text=True, check=True, env=bare).stdout.strip().split(";")[0]  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not list((run_dir / "registry" / "inference").glob("*.json")):
            log = run_dir / "logs" / "inference" / "attempt_1.log"
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(1.0)
    finally:
        subprocess.run(["scancel", job], timeout=60)
    log = (run_dir / "logs" / "inference" / "attempt_1.log").read_text()
    assert f"job {job}" in log and "inference servers ready" in log
