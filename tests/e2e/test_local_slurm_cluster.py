"""The 2-node Slurm cluster of `scripts/local_slurm.sh up --nodes 2` (two network namespaces on one machine).

Checks what multi-node stage jobs rely on: two nodes with their own hostnames and addresses that resolve each
other, a 2-node batch job whose torchrun ranks rendezvous and all-reduce (gloo) across the namespaces,
accounting (`sacct`) for the cluster from the root namespace and from inside a node, and a bring-up that is a
no-op when the cluster is up. Clients that open listening sockets (srun) run inside node1 (`ip netns exec`), so
nothing listens on the machine's own interfaces. Node loss (`stop-node`/`start-node`) is exercised by the
launcher's e2e tests. Skipped with the reason when the cluster is not up (CI brings it up in scripts/test.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("ARL_SLURM2_DIR", "/tmp/arl-slurm2"))
CONF = STATE / "slurm.conf"
ENV = {**os.environ, "SLURM_CONF": str(CONF)}
NODES = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
IN_NODE1 = ["ip", "netns", "exec", "arl-node1", "env", f"SLURM_CONF={CONF}"]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}  # fmt: skip
PYTHON = REPO / ".venv" / "bin" / "python" if (REPO / ".venv" / "bin" / "python").exists() else Path(sys.executable)


def _skip_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm commands not installed (run scripts/local_slurm.sh up --nodes 2)"
    if not CONF.exists():
        return f"2-node Slurm cluster is not up (no {CONF}): run scripts/local_slurm.sh up --nodes 2"
    probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=ENV, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"2-node Slurm cluster does not answer (scripts/local_slurm.sh up --nodes 2): {probe.stderr[:200]}"
    return None


pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None,
                                                                      reason=_skip_reason() or "")]  # fmt: skip


def run(*args: str, timeout: float = 60) -> str:
    """Run a command against the 2-node cluster; its stdout, or an AssertionError with its stderr."""
    done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


def node_states() -> dict[str, str]:
    return dict(line.split() for line in run("sinfo", "-h", "-N", "-o", "%N %T").splitlines())


def sacct_state(job_id: str, *, in_node: bool = False) -> str:
    out = run(*(IN_NODE1 if in_node else []), "sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State")
    return (out.split() or ["?"])[0]


def wait_for_final_state(job_id: str, timeout: float) -> str:
    """Poll sacct (faster than `sbatch --wait`) until the job is in a final state; that state."""
    deadline = time.monotonic() + timeout
    while (state := sacct_state(job_id)) not in FINAL_STATES:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout}s"
        time.sleep(0.5)
    return state


def test_both_nodes_are_idle() -> None:
    # A job of an earlier test may still be completing: give it a few seconds, then insist.
    deadline = time.monotonic() + 20
    while (states := node_states()) != {"node1": "idle", "node2": "idle"} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert states == {"node1": "idle", "node2": "idle"}


def test_srun_runs_a_task_on_each_node_with_its_hostname_and_address() -> None:
    # Each task prints: job id, node id, hostname, eth0 address, and what the other node's name resolves to.
    task = ('other=$([ "$(hostname)" = node1 ] && echo node2 || echo node1); '
            'echo "$SLURM_JOB_ID $SLURM_NODEID $(hostname) $(ip -4 -o addr show eth0 | awk \'{print $4}\') '
            '$other=$(getent hosts $other | awk \'{print $1}\')"')  # fmt: skip
    out = run(*IN_NODE1, "srun", "-N2", "--ntasks-per-node=1", "bash", "-c", task)
    rows = sorted(line.split() for line in out.splitlines())
    assert [row[1:] for row in rows] == [["0", "node1", "10.77.0.11/24", "node2=10.77.0.12"],
                                         ["1", "node2", "10.77.0.12/24", "node1=10.77.0.11"]], out  # fmt: skip
    job_id = rows[0][0]
    assert wait_for_final_state(job_id, timeout=20) == "COMPLETED"
    assert sacct_state(job_id, in_node=True) == "COMPLETED"


DDP_CHECK = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank={rank} world={world} host={socket.gethostname()} allreduce={t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_two_node_batch_job_all_reduces_across_the_nodes_with_torchrun(tmp_path: Path) -> None:
    (tmp_path / "ddp_check.py").write_text(DDP_CHECK)
    (tmp_path / "job.sh").write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun {PYTHON} -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
    --rdzv-endpoint=$head:$((29500 + SLURM_JOB_ID % 1000)) --rdzv-id=$SLURM_JOB_ID {tmp_path / "ddp_check.py"}
""")
    out_file = tmp_path / "job.out"
    job_id = run("sbatch", "--parsable", "-o", str(out_file), str(tmp_path / "job.sh")).strip().split(";")[0]

    state = wait_for_final_state(job_id, timeout=90)
    output = out_file.read_text(errors="replace") if out_file.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output[-4000:]}"
    results = sorted(line for line in output.splitlines() if line.startswith("rank="))
    assert results == ["rank=0 world=2 host=node1 allreduce=3.0", "rank=1 world=2 host=node2 allreduce=3.0"], output
    assert sacct_state(job_id, in_node=True) == "COMPLETED"
    assert run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "NodeList").split() == ["node[1-2]"]


def pids() -> dict[str, str]:
    return {f.name: f.read_text().strip() for f in sorted((STATE / "run").glob("*.pid"))}


@pytest.mark.skipif(os.geteuid() != 0, reason="scripts/local_slurm.sh up needs root")
def test_up_again_is_a_no_op() -> None:
    before = pids()
    assert set(before) == {"slurmctld.pid", "slurmd-node1.pid", "slurmd-node2.pid"}
    done = subprocess.run([str(REPO / "scripts" / "local_slurm.sh"), "up", "--nodes", "2"],
                          env={**os.environ, "ARL_SLURM2_DIR": str(STATE)}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "already running" in done.stderr and "starting" not in done.stderr, done.stderr
    assert pids() == before
    for pid in before.values():
        os.kill(int(pid), 0)  # still alive: nothing was restarted
    assert set(node_states().values()) <= {"idle", "mixed", "allocated"}
