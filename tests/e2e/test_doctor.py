"""`arl doctor` on CPU: the whole harness that `arl doctor --gpu` runs on a GPU node, minus the GPU.

The CLI runs as a subprocess (a real 2-step pipeline: hf server, rollout with the demo agent, torch
trainer, gloo broadcast publication) and must pass every check; `--gpu` here (no CUDA) is a
one-line usage error; and the weight check must be able to fail, against a live hf server whose
weights are another seed's while the checkpoint is the trained one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.demo.doctor_checks import check_served_weights
from pipeline.demo.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def arl(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    workdir = tmp_path_factory.mktemp("doctor")
    return arl("doctor", "--steps", "2", "--workdir", str(workdir)), workdir


def test_doctor_on_cpu_passes_every_check(doctor_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, _ = doctor_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for name in ("pipeline ran", "trajectory shards", "checkpoints", "served version", "served weights",
                 "weights moved", "weight publication"):  # fmt: skip
        assert name in out, out
    assert "FAIL" not in out
    assert "all checks passed" in out
    assert "gloo broadcast" in out


def test_gpu_without_cuda_is_a_one_line_usage_error(tmp_path: Path) -> None:
    result = arl("doctor", "--gpu", "--model", str(tmp_path), "--workdir", str(tmp_path), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gpu" in lines[0] and "CUDA" in lines[0], result.stderr
    assert not (tmp_path / "doctor").exists()  # nothing started


def test_gpu_acceptance_script_runs_doctor_gpu_and_keeps_its_log(tmp_path: Path) -> None:
    log = tmp_path / "acceptance.log"
    env = {**os.environ, "ARL_PYTHON": sys.executable, "ARL_DOCTOR_LOG": str(log)}
    result = subprocess.run([str(REPO / "scripts" / "gpu_acceptance.sh"), "--model", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 2  # arl doctor --gpu's own status: no CUDA here
    assert "--gpu: no CUDA device" in log.read_text()


def test_gpu_backend_on_cpu_is_a_usage_error(tmp_path: Path) -> None:
    result = arl("doctor", "--backend", "sglang", "--workdir", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "needs a GPU" in result.stderr


def test_weight_check_fails_against_a_server_with_other_weights(
    doctor_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    from pipeline.engine.server.hf.process import start_hf_server

    _, workdir = doctor_run
    checkpoints = sorted(workdir.glob("doctor/*/checkpoints/step_000002"))
    assert checkpoints, "the doctor run left no checkpoint"
    other = make_tiny_model(tmp_path / "other-seed", seed=7)
    with start_hf_server(other) as handle:
        served, moved = check_served_weights(handle.url, checkpoints[0], workdir / "tiny-model", temperature=1.0,
                                             dtype="float32")  # fmt: skip
    assert served.name == "served weights" and not served.ok, served
    assert "max |server - trainer|" in served.detail
    assert moved.ok, moved  # the trained checkpoint did move away from the initial model
