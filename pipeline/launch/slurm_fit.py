"""The Slurm side of the pre-launch checks: does every stage's request fit the cluster it goes to?

Read from `sinfo` (partitions, their nodes and each node's GPUs) and `sacctmgr` (the user's accounts):
a partition that does not exist, more nodes or GPUs per node than a partition has, a node list naming
unknown nodes, or an account the user has no association with, each becomes one `Problem` before
anything is queued, instead of a job that pends for ever or an sbatch error after half the run was
submitted.
"""

from __future__ import annotations

import getpass
import re
import subprocess
from dataclasses import dataclass, field

from pipeline.launch.preflight import Outcome, Problem, slurm_commands_here
from pipeline.run.stage import stages_for
from schemas.config import ArlConfig, StageResources


@dataclass
class Partition:
    name: str
    default: bool = False
    nodes: list[str] = field(default_factory=list)
    gpus: dict[str, int] = field(default_factory=dict)
    """GPUs per node, from each node's `gres` (`gpu:8`, `gpu:h100:8(S:0-1)`)."""


def check_slurm(config: ArlConfig, *, executor: str, submit: bool) -> Outcome:
    if executor != "slurm":
        return Outcome("", detail="local executor: no Slurm", skipped=True)
    if not slurm_commands_here():
        if submit:
            return Outcome(
                "",
                problems=[
                    Problem(
                        "--executor",
                        "slurm",
                        "no sbatch/sinfo on this machine: run on a Slurm login node, or pass --executor local",
                    )
                ],
            )
        return Outcome("", detail="no Slurm commands here: not checked (dry run)", skipped=True)
    partitions = read_partitions()
    if not partitions:
        return Outcome("", problems=[Problem("--executor", "slurm", "sinfo lists no partition: is the cluster up?")])
    problems: list[Problem] = _proxy_cores(config)
    accounts = _user_accounts()
    for stage in stages_for(config):
        problems += _stage_problems(stage, getattr(config.cluster, stage), partitions, accounts)
    names = ", ".join(f"{p.name}{'*' if p.default else ''}" for p in partitions.values())
    return Outcome("", detail=f"partitions {names}", problems=problems)


def read_partitions() -> dict[str, Partition]:
    """Partitions by name with their nodes and GPUs per node (`sinfo -N`: one line per node and partition)."""
    out = _run(["sinfo", "-h", "-N", "-o", "%P|%N|%G"])
    partitions: dict[str, Partition] = {}
    for line in out.splitlines():
        name, node, gres = [*line.split("|"), "", ""][:3]
        default = name.endswith("*")
        part = partitions.setdefault(name.rstrip("*"), Partition(name.rstrip("*")))
        part.default |= default
        if node and node not in part.nodes:
            part.nodes.append(node)
            part.gpus[node] = gpus_in(gres)
    return partitions


def gpus_in(gres: str) -> int:
    """GPUs in a node's gres string: `gpu:8`, `gpu:h100:8(S:0-1)`, `gpu:a100:4,nic:1`; 0 for `(null)`."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(,]+)?:(\d+)", item.strip())
        if match:
            total += int(match.group(1))
    return total


def _proxy_cores(config: ArlConfig) -> list[Problem]:
    """Each proxy worker is one busy process: fewer CPUs than workers and they only take turns on them."""
    stage = "proxy" if config.rollout.source == "external" else "rollout"
    cpus = getattr(config.cluster, stage).cpus_per_task
    if config.proxy.workers > cpus:
        return [
            Problem(
                f"cluster.{stage}.cpus_per_task",
                cpus,
                f"fewer CPUs than proxy.workers={config.proxy.workers}"
                f" (one core each): raise it to at least {config.proxy.workers}, or lower proxy.workers",
            )
        ]
    return []


def _stage_problems(
    stage: str, res: StageResources, partitions: dict[str, Partition], accounts: set[str] | None
) -> list[Problem]:
    key = f"cluster.{stage}"
    part = partitions.get(res.partition) if res.partition else next((p for p in partitions.values() if p.default), None)
    if res.partition and part is None:
        return [Problem(f"{key}.partition", res.partition, f"no such partition (sinfo lists: {', '.join(partitions)})")]
    problems = []
    if part is not None:
        where = f"partition {part.name}"
        if res.nodes > len(part.nodes):
            problems.append(Problem(f"{key}.nodes", res.nodes, f"{where} has {len(part.nodes)} node(s)"))
        most = max(part.gpus.values(), default=0)
        if res.gpus_per_node > most:
            problems.append(
                Problem(
                    f"{key}.gpus_per_node",
                    res.gpus_per_node,
                    f"no node of {where} has that many GPUs (most: {most}); CPU-only partitions need gpus_per_node: 0",
                )
            )
        for option in ("nodelist", "exclude"):
            value = getattr(res, option)
            unknown = [n for n in _hostnames(value) if n not in part.nodes] if value else []
            if unknown:
                problems.append(
                    Problem(f"{key}.{option}", value, f"{', '.join(unknown)} not in {where} ({', '.join(part.nodes)})")
                )
    if res.account and accounts is not None and res.account not in accounts:
        problems.append(
            Problem(
                f"{key}.account",
                res.account,
                f"{getpass.getuser()} has no association with it "
                f"(sacctmgr lists: {', '.join(sorted(accounts)) or 'none'})",
            )
        )
    return problems


def _user_accounts() -> set[str] | None:
    """The user's accounts per `sacctmgr`; None when accounting cannot be asked (then not checked)."""
    try:
        proc = subprocess.run(
            ["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


def _hostnames(expression: str) -> list[str]:
    """`node[1-3],gpu7` -> its host names, by `scontrol show hostnames` (Slurm's own expansion)."""
    out = _run(["scontrol", "show", "hostnames", expression])
    return out.split() or [expression]


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
