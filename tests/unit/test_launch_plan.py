"""Stage plans and sbatch scripts: every resource option, setup lines, the torchrun line for a multi-GPU trainer."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.launch.plan import plan_run, plan_stage, sbatch_directives, sbatch_script_path
from pipeline.launch.sbatch import render_sbatch
from pipeline.run.config import load_config
from pipeline.run.paths import RunPaths
from pipeline.run.stage import stages_for
from schemas.config import StageResources

FULL = [
    "cluster.train.partition=gpu",
    "cluster.train.account=proj42",
    "cluster.train.qos=high",
    "cluster.train.time_min=90",
    "cluster.train.nodes=2",
    "cluster.train.gpus_per_node=8",
    "cluster.train.cpus_per_task=32",
    "cluster.train.mem_gb=480",
    "cluster.train.constraint=h100&ib",
    "cluster.train.exclusive=true",
    "cluster.train.extra_sbatch=['--reservation=rl', '#SBATCH --mail-type=END']",
    "cluster.train.setup=['module load cuda/12.4', 'source /opt/venv/bin/activate']",
    "cluster.setup=['export HF_HOME=/shared/hf']",
]


def _script(tmp_path: Path, overrides: list[str], stage: str, **kwargs: object) -> str:
    config = load_config(None, overrides)
    paths = RunPaths(tmp_path / "run")
    plan = plan_stage(config, stage, paths.root)
    return render_sbatch(plan, config, paths, attempt=3, workdir=tmp_path, **kwargs)  # type: ignore[arg-type]


def _sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_every_resource_option_becomes_one_sbatch_line(tmp_path: Path) -> None:
    lines = _sbatch_lines(_script(tmp_path, FULL, "train"))
    for expected in ("--partition=gpu", "--account=proj42", "--qos=high", "--time=90", "--nodes=2",
                     "--gpus-per-node=8", "--cpus-per-task=32", "--mem=480G", "--constraint='h100&ib'",
                     "--exclusive", "--reservation=rl", "--mail-type=END", "--ntasks-per-node=1",
                     "--job-name=arl-demo-trial0-train", "--open-mode=append"):  # fmt: skip
        assert lines.count(expected) == 1, (expected, lines)
    assert f"--output={tmp_path}/run/logs/train/attempt_3.log" in lines
    assert f"--chdir={tmp_path}" in lines


def test_defaults_request_no_gpus_memory_or_partition(tmp_path: Path) -> None:
    """A CPU-only cluster refuses `--gres=gpu`, so the defaults must not ask for any."""
    directives = sbatch_directives(StageResources())
    assert directives == ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=60"]


def test_setup_lines_run_in_order_before_the_stage(tmp_path: Path) -> None:
    script = _script(tmp_path, FULL, "train")
    order = [script.index(s) for s in ("export HF_HOME=/shared/hf", "module load cuda/12.4",
                                       "source /opt/venv/bin/activate", "srun ")]  # fmt: skip
    assert order == sorted(order)
    # the stage-specific setup belongs to the trainer only
    assert "module load cuda/12.4" not in _script(tmp_path, FULL, "inference")
    assert "export HF_HOME=/shared/hf" in _script(tmp_path, FULL, "inference")


def test_multi_gpu_trainer_runs_torchrun_once_per_node(tmp_path: Path) -> None:
    script = _script(tmp_path, FULL, "train")
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    argv = shlex.split(srun)
    assert argv[:5] == ["srun", "--export=ALL", "--ntasks-per-node=1", "--cpus-per-task=${SLURM_CPUS_PER_TASK:-1}",
                        "--kill-on-bad-exit=1"]  # fmt: skip
    assert argv[5:7] == ["bash", "-c"]
    inner = shlex.split(argv[7])
    assert inner[0] == "exec" and inner[2:4] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in inner and "--nproc-per-node=8" in inner and "--rdzv-backend=c10d" in inner
    assert inner[-6:] == ["-m", "pipeline.cli", "stage", "train", "--run-dir", str(tmp_path / "run")]
    assert "MASTER_ADDR=$(scontrol show hostnames" in script


@pytest.mark.parametrize(("nodes", "gpus", "torchrun"), [(1, 0, False), (1, 1, False), (1, 2, True), (2, 0, True)])
def test_torchrun_only_when_the_trainer_spans_processes(tmp_path: Path, nodes: int, gpus: int, torchrun: bool) -> None:
    config = load_config(None, [f"cluster.train.nodes={nodes}", f"cluster.train.gpus_per_node={gpus}"])
    plan = plan_stage(config, "train", tmp_path)
    assert plan.torchrun is torchrun
    if not torchrun:
        assert plan.argv == [sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(tmp_path)]


def test_only_the_trainer_and_the_inference_servers_span_nodes(tmp_path: Path) -> None:
    for stage in ("rollout", "proxy"):  # refused with the config, before any run dir exists
        with pytest.raises(ConfigError, match=rf"cluster.{stage}.nodes=2: only the trainer and the inference"):
            load_config(None, [f"cluster.{stage}.nodes=2"])
    config = load_config(None, ["cluster.inference.nodes=3"])
    plan = plan_stage(config, "inference", tmp_path)  # srun runs the stage once on each node
    assert not plan.torchrun and plan.argv[-4:] == ["stage", "inference", "--run-dir", str(tmp_path)]
    assert "--nodes=3" in sbatch_directives(plan.resources)


def test_external_agents_run_the_standalone_proxy_instead_of_rollout(tmp_path: Path) -> None:
    assert stages_for(load_config(None)) == ["inference", "rollout", "train"]
    external = load_config(None, ["rollout.source=external", "proxy.client_keys=[k]"])
    assert [p.stage for p in plan_run(external, tmp_path)] == ["inference", "proxy", "train"]


def test_extra_sbatch_must_be_an_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be one sbatch option"):
        sbatch_directives(StageResources(extra_sbatch=["reservation=rl"]))


def test_submitit_script_differs_only_in_how_the_stage_is_started(tmp_path: Path) -> None:
    plain = _script(tmp_path, [], "rollout").splitlines()
    via = _script(tmp_path, [], "rollout", submitit_command="python -u -m submitit.core._submit F").splitlines()
    assert via[-1].endswith("--kill-on-bad-exit=1 python -u -m submitit.core._submit F")
    assert plain[-1].endswith("-m pipeline.cli stage rollout --run-dir " + str(tmp_path / "run"))
    assert "export SUBMITIT_EXECUTOR=slurm" in via
    extra = {"export SUBMITIT_EXECUTOR=slurm"}
    assert [line for line in via[:-1] if line not in extra and not line.startswith("# submitit's")] == plain[:-1]


def test_rendered_scripts_are_valid_bash(tmp_path: Path) -> None:
    for stage in ("inference", "rollout", "train"):
        script = tmp_path / f"{stage}.sbatch"
        script.write_text(_script(tmp_path, FULL, stage))
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_dry_run_script_location(tmp_path: Path) -> None:
    assert sbatch_script_path(RunPaths(tmp_path), "train") == tmp_path / "sbatch" / "train.sbatch"


def test_stages_are_pinned_to_or_kept_off_nodes(tmp_path: Path) -> None:
    overrides = ["cluster.inference.nodelist=gpu[01-04]", "cluster.train.exclude=node7,node9"]
    assert "--nodelist='gpu[01-04]'" in _sbatch_lines(_script(tmp_path, overrides, "inference"))
    lines = _sbatch_lines(_script(tmp_path, overrides, "train"))
    assert "--exclude=node7,node9" in lines and not any(line.startswith("--nodelist") for line in lines)


@pytest.mark.parametrize("stage", ["inference", "rollout", "train"])
def test_network_interface_reaches_every_stage_as_gloo_and_nccl_variables(tmp_path: Path, stage: str) -> None:
    script = _script(tmp_path, ["cluster.network_interface=ib0", "cluster.train.nodes=2"], stage)
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    shown = subprocess.run(["bash", "-c", exports.replace("$(scontrol", "$(echo") + "\nenv"], capture_output=True,
                           text=True, check=True, env={"SLURM_JOB_ID": "5"}).stdout.splitlines()  # fmt: skip
    assert "GLOO_SOCKET_IFNAME=ib0" in shown and "NCCL_SOCKET_IFNAME=ib0" in shown
    assert plan_stage(load_config(None, ["cluster.network_interface=ib0"]), stage, tmp_path).env == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}  # fmt: skip
    assert "IFNAME" not in _script(tmp_path, [], stage)


def test_network_interface_must_be_an_interface_name() -> None:
    with pytest.raises(ConfigError, match="network_interface"):
        load_config(None, ["cluster.network_interface=eth0; rm -rf /"])


@pytest.mark.parametrize("job_id", [1, 12767, 12768, 31999, 4_000_000_123])
def test_rendezvous_port_stays_below_the_ephemeral_range(tmp_path: Path, job_id: int) -> None:
    """Other stages on the trainer's first node listen on ports the kernel picks (32768 and up): no clash."""
    script = _script(tmp_path, ["cluster.train.nodes=2"], "train")
    line = next(line for line in script.splitlines() if line.startswith("export MASTER_ADDR"))
    port = subprocess.run(["bash", "-c", f"{line}; echo $MASTER_PORT"], capture_output=True, text=True, check=True,
                          env={"SLURM_JOB_ID": str(job_id)}).stdout.strip()  # fmt: skip
    assert 20000 <= int(port) < 32768
