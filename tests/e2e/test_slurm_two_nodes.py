"""The pipeline spread over a real 2-node Slurm cluster (`scripts/local_slurm.sh up --nodes 2`), then node loss.

Placement: the inference server on node2, the proxy stage (it turns agent sessions into shards) on node1,
the trainer as one job over both nodes (torchrun, gloo, FSDP2), weights broadcast from node1 to the server
on node2, and an outside agent process on node2 that finds the proxy on node1 through the run's registry.
Each node is a network namespace with its own address, so every one of those hops crosses the bridge.

Node loss, twice: the job on node2 is cancelled, then node2 itself is lost (its slurmd stopped and every
process on it killed, as on a crashed machine). Each time `arl status` names the job and the node and what
to do, `arl launch --resume` relaunches what died, and the run finishes with every step exactly once.
Written against the run-dir contract (docs/run-directory.md) and the logs, not against stage internals.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = Path(os.environ.get("ARL_SLURM2_DIR", "/tmp/arl-slurm2"))
ENV = {**os.environ, "SLURM_CONF": str(CLUSTER / "slurm.conf"), "COLUMNS": "200"}
NODE_IP = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
NUM_STEPS = 6
CLIENT_KEY = "ck-example-team"


def _skip_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm commands not installed (scripts/local_slurm.sh up --nodes 2)"
    if not (CLUSTER / "slurm.conf").exists():
        return f"the 2-node cluster is down: no {CLUSTER}/slurm.conf (scripts/local_slurm.sh up --nodes 2)"
    probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=ENV, timeout=30)
    usable = {line.split()[0] for line in probe.stdout.splitlines() if line.split()[1:2] in (["idle"], ["mix"])}
    if usable != {"node1", "node2"}:
        return f"the 2-node cluster is not idle (sinfo: {probe.stdout.strip() or probe.stderr.strip()})"
    return None


pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None,
                                                                      reason=_skip_reason() or "")]  # fmt: skip


def arl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=ENV, timeout=timeout)  # fmt: skip


def slurm(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=ENV, timeout=60, check=True)
    return proc.stdout.strip()


def sacct(job_id: str, field: str = "State") -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", field], capture_output=True, text=True,
                         env=ENV, timeout=60).stdout.split("\n")[0].strip()  # fmt: skip
    return out.split()[0] if out and field == "State" else out


def ended(job_id: str, state: str) -> bool:
    """`state` in sacct and gone from squeue (a cancelled job stays COMPLETING there a moment)."""
    queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=ENV, timeout=60)
    return sacct(job_id) == state and not queued.stdout.strip()


def jobs(run_dir: Path) -> dict[str, list[dict[str, object]]]:
    stages: dict[str, list[dict[str, object]]] = json.loads((run_dir / "jobs.json").read_text())["stages"]
    return stages


def wait_until(check: Callable[[], bool], what: str, run_dir: Path, timeout: float, *, watch: bool = True) -> None:
    """Poll `check`; with `watch`, fail at once (with the log's tail) when a stage's newest job failed."""
    deadline = time.monotonic() + timeout
    while not check():
        for stage, entries in jobs(run_dir).items() if watch else []:
            job = str(entries[-1]["job_id"])
            if sacct(job) in ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED"):
                tail = Path(str(entries[-1]["log"])).read_text(errors="replace")[-4000:]
                raise AssertionError(f"stage {stage} (job {job}) ended while waiting for {what}; its log ends:\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{arl('status', str(run_dir)).stdout}")
        time.sleep(1.0)


def version(run_dir: Path) -> int:
    from pipeline.launch.launcher import finished_version
    from pipeline.run.paths import RunPaths

    return finished_version(RunPaths(run_dir))


def submit_agent(run_dir: Path, log: Path) -> str:
    """The outside agent: a batch job of its own on node2, reading the proxy's URL from the run's registry."""
    agent = [sys.executable, str(REPO / "examples" / "external_agent.py"), str(run_dir), "--client-key", CLIENT_KEY,
             "--group-size", "4", "--limit", "4", "--until-done"]  # fmt: skip
    wrap = f"echo agent on $(hostname); exec {' '.join(agent)}"
    return slurm("sbatch", "--parsable", "--nodelist=node2", "--job-name=arl-two-nodes-agent", f"--output={log}",
                 "--open-mode=append", f"--chdir={REPO}", "--time=30", "--wrap", wrap).split(";")[0]  # fmt: skip


@pytest.fixture
def node_control() -> Iterator[Callable[[str, str], None]]:
    """`scripts/local_slurm.sh stop-node|start-node NAME`; a node stopped here is always started again."""
    stopped: set[str] = set()

    def control(action: str, node: str) -> None:
        subprocess.run([str(REPO / "scripts" / "local_slurm.sh"), action, node], check=True, timeout=120, env=ENV)
        (stopped.add if action == "stop-node" else stopped.discard)(node)

    yield control
    for node in sorted(stopped):
        subprocess.run([str(REPO / "scripts" / "local_slurm.sh"), "start-node", node], timeout=120, env=ENV)


def test_pipeline_across_two_nodes_survives_losing_one(tmp_path: Path, tiny_model_dir: Path,
                                                       node_control: Callable[[str, str], None]) -> None:  # fmt: skip
    run_dir = tmp_path / "runs" / "two-nodes" / "t0"
    # Synchronous (max_staleness 0) so that the run cannot finish before the losses land.
    overrides = [f"fileroot={tmp_path / 'runs'}", "experiment_name=two-nodes", "trial_name=t0",
                 f"num_steps={NUM_STEPS}", f"model.path={tiny_model_dir}", "inference.host=0.0.0.0",
                 "proxy.host=0.0.0.0", "proxy.session_timeout_s=30", "rollout.max_staleness=0",
                 "trainer.weight_sync=nccl", "trainer.broadcast_timeout_s=60", "cluster.inference.nodelist=node2",
                 "cluster.proxy.nodelist=node1", "cluster.train.nodes=2"]  # fmt: skip
    config = str(REPO / "examples" / "external.yaml")
    agents: list[str] = []
    try:
        launched = arl("launch", config, *overrides, "--executor", "slurm")
        assert launched.returncode == 0, launched.stdout + launched.stderr
        agents.append(submit_agent(run_dir, tmp_path / "agent.log"))
        first = {stage: str(e[0]["job_id"]) for stage, e in jobs(run_dir).items()}
        assert sorted(first) == ["inference", "proxy", "train"]

        wait_until(lambda: version(run_dir) >= 1, "the first weight version", run_dir, timeout=600)
        _assert_placement(run_dir, first)

        # 1. the job on node2 is cancelled: status names it and its node; a resume relaunches only it
        slurm("scancel", first["inference"])
        wait_until(lambda: ended(first["inference"], "CANCELLED"), "the cancel", run_dir, 120, watch=False)
        status = arl("status", str(run_dir))
        flat = " ".join(status.stdout.split())
        assert status.returncode == 1, status.stdout
        assert f"stage inference died: job {first['inference']} (attempt 1) ended CANCELLED on node2" in flat, flat
        resumed = arl("launch", config, *overrides, "--executor", "slurm", "--resume")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        attempts = {stage: [e["attempt"] for e in entries] for stage, entries in jobs(run_dir).items()}
        assert attempts == {"inference": [1, 2], "proxy": [1], "train": [1]}
        recovered_from = version(run_dir)
        wait_until(lambda: version(run_dir) > recovered_from, "a version served by the relaunched server", run_dir,
                   timeout=600)  # fmt: skip
        assert version(run_dir) < NUM_STEPS, "the run finished before node2 could be lost"

        # 2. node2 is lost: its jobs end NODE_FAIL; status says which node, which jobs, and what to do
        on_node2 = {"inference": str(jobs(run_dir)["inference"][-1]["job_id"]), "train": first["train"]}
        node_control("stop-node", "node2")
        for stage, job in on_node2.items():
            wait_until(lambda job=job: ended(job, "NODE_FAIL"), f"{stage} job {job} to end NODE_FAIL", run_dir,
                       timeout=180, watch=False)  # fmt: skip
        flat = " ".join(arl("status", str(run_dir)).stdout.split())
        for stage, job in on_node2.items():
            assert f"stage {stage} died: job {job}" in flat and "ended NODE_FAIL on node" in flat, flat
        assert "node node2 is down" in flat and "exclude=node2" in flat, flat
        assert "stage proxy died" not in flat  # node1's proxy lives on
        node_control("start-node", "node2")
        assert "its node failed and is back in service now" in " ".join(arl("status", str(run_dir)).stdout.split())
        resumed = arl("launch", config, *overrides, "--executor", "slurm", "--resume")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        agents.append(submit_agent(run_dir, tmp_path / "agent.log"))
        attempts = {stage: [e["attempt"] for e in entries] for stage, entries in jobs(run_dir).items()}
        assert attempts == {"inference": [1, 2, 3], "proxy": [1], "train": [1, 2]}

        train = str(jobs(run_dir)["train"][-1]["job_id"])
        wait_until(lambda: sacct(train) in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"), "the trainer to finish",
                   run_dir, timeout=900)  # fmt: skip
        assert sacct(train) == "COMPLETED", Path(str(jobs(run_dir)["train"][-1]["log"])).read_text()[-3000:]
        _assert_run_complete(run_dir)
        _assert_data_crossed_nodes(run_dir, tmp_path / "agent.log")
    finally:
        subprocess.run(["scancel", *agents], env=ENV, timeout=60)
        arl("stop", str(run_dir))


def _assert_placement(run_dir: Path, first: dict[str, str]) -> None:
    """Each stage ran where it was sent; the servers and the proxy registered their node, not loopback."""
    assert sacct(first["inference"], "NodeList") == "node2"
    assert sacct(first["proxy"], "NodeList") == "node1"
    assert sacct(first["train"], "NodeList") == "node[1-2]"
    (server,) = [json.loads(p.read_text()) for p in (run_dir / "registry" / "inference").glob("*.json")]
    assert server["host"] == "node2" and server["url"].startswith("http://node2:"), server
    (proxy,) = [json.loads(p.read_text()) for p in (run_dir / "registry" / "proxy").glob("*.json")]
    assert proxy["host"] == "node1" and proxy["url"].startswith("http://node1:"), proxy
    group = json.loads((run_dir / "registry" / "weight_sync.json").read_text())
    assert group["master_address"] == NODE_IP["node1"], group  # the broadcast's rendezvous is node1's address


def _assert_run_complete(run_dir: Path) -> None:
    """Every step exactly once, shards valid, no session in two steps, checkpoints and metrics complete."""
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step

    paths = RunPaths(run_dir)
    assert paths.complete_steps() == list(range(NUM_STEPS))
    seen: set[str] = set()
    for step in range(NUM_STEPS):
        table = read_step(paths, step)  # verifies the manifest's sha256 of every part
        assert table.num_rows > 0 and set(table.column("step").to_pylist()) == {step}
        sessions = set(table.column("session_id").to_pylist())
        assert not seen & sessions
        seen |= sessions
    assert paths.complete_checkpoints()[-1] == NUM_STEPS
    assert (paths.checkpoint_dir(NUM_STEPS) / "config.json").exists()
    assert json.loads(paths.weight_version.read_text())["version"] == NUM_STEPS
    train = [json.loads(line) for line in paths.train_metrics.read_text().splitlines() if line.strip()]
    assert sorted({t["step"] for t in train}) == list(range(NUM_STEPS))
    assert {t["world_size"] for t in train} == {2}  # one rank on each node


def _assert_data_crossed_nodes(run_dir: Path, agent_log: Path) -> None:
    """The addresses the servers saw: the proxy on node1 called the server on node2, the agent on node2 the proxy."""
    server_logs = " ".join(p.read_text(errors="replace") for p in (run_dir / "logs" / "inference").glob("server-*"))
    assert f"first request from {NODE_IP['node1']}" in server_logs
    proxy_log = (run_dir / "logs" / "proxy" / "attempt_1.log").read_text(errors="replace")
    assert f"proxy: first request from {NODE_IP['node2']}" in proxy_log
    agent = agent_log.read_text(errors="replace")
    assert agent.count("agent on node2") == 2 and "finished" in agent


def test_one_inference_job_serves_from_both_nodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`cluster.inference.nodes: 2`: the stage runs on each node, each registering its own server."""
    import httpx

    run_dir = tmp_path / "runs" / "inference-nodes" / "t0"
    overrides = [f"fileroot={tmp_path / 'runs'}", "experiment_name=inference-nodes", "trial_name=t0",
                 f"model.path={tiny_model_dir}", "inference.host=0.0.0.0", "cluster.inference.nodes=2"]  # fmt: skip
    dry = arl("launch", str(REPO / "examples" / "demo.yaml"), *overrides, "--prepare")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    job = slurm("sbatch", "--parsable", str(run_dir / "sbatch" / "inference.sbatch")).split(";")[0]
    registry = run_dir / "registry" / "inference"
    try:
        deadline = time.monotonic() + 300
        while len(list(registry.glob("*.json"))) < 2:
            assert sacct(job) in ("", "PENDING", "RUNNING"), (run_dir / "logs" / "inference").glob("*")
            assert time.monotonic() < deadline, "the two servers did not register within 300 s"
            time.sleep(1.0)
        entries = sorted((json.loads(p.read_text()) for p in registry.glob("*.json")), key=lambda e: e["host"])
        assert [e["host"] for e in entries] == ["node1", "node2"]
        for entry in entries:
            assert entry["url"].startswith(f"http://{entry['host']}:")
            port = entry["url"].rsplit(":", 1)[1]
            info = httpx.get(f"http://{NODE_IP[entry['host']]}:{port}/get_model_info", timeout=30).json()
            assert info["weight_version"] in ("0", 0), info
        # server indices are global across the job: one log per server, none shared
        assert sorted(p.name for p in (run_dir / "logs" / "inference").glob("server-*")) == [
            "server-0.attempt_1.log", "server-1.attempt_1.log"]  # fmt: skip
    finally:
        subprocess.run(["scancel", job], env=ENV, timeout=60)
    deadline = time.monotonic() + 120
    while not (registry.is_dir() and not list(registry.glob("*.json"))) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not list(registry.glob("*.json")), "a cancelled server left its registry entry behind"
