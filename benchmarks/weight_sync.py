"""Weight publication to a real `hf` server, broadcast (gloo) and disk, against the raw gloo bandwidth.

All figures come from one run on one machine, so the ratios compare like with like:

* gloo bandwidth (measured before and after the publications, pooled, as the machine's load
  drifts): rank 0 broadcasts a large fp32 tensor to one receiver process over loopback TCP with the
  publication's own code (`init_weight_group`, `broadcast_from_trainer`), received two ways,
  alternating: into one preallocated tensor (the transport alone: the ceiling) and with
  `receive_from_trainer` (a fresh tensor per receive, as the server does). Each broadcast ends with
  a one-byte broadcast back from the receiver, so the clock stops when the bytes have arrived.
* publication, for the tiny model (`pipeline.demo.tiny_model`) and a ~0.5B-parameter model of the same
  architecture and builder (Qwen2, random init, hidden 1024, 30 layers, vocab 32k, tied
  embeddings; fp32, ~2 GB): one `hf` server (`python -m pipeline.engine.server.hf.process`, CPU, fp32) on
  loopback, found through the run directory's registry, updated by arl's publisher
  (`pipeline.trainer.publish.publisher.make_publisher`, verification on as with `trainer.verify`) with
  `nccl` (the gloo broadcast on CPU) and then `disk` (the server reloads a checkpoint written by
  `save_checkpoint`, whose time is reported apart). The first two broadcast publications are not
  timed with the others: they build the group and touch fresh memory on both sides (several times
  slower); the first is reported apart.
* from each `PublishReport`: the swap (`sync_s`: pause and move the tensors) and the verification
  (`verify_s`: the servers' probe and weight-sample checks, and any wait for the trainer's own
  reference forward of the probe, which runs while the tensors travel). The 0.5B model is also
  broadcast with verification off, which times the transport alone: on 2 cores the overlapping
  reference forward competes with gloo for the CPU. This process plays the trainer
  with `OMP_WAIT_POLICY=PASSIVE` like the server (unless set otherwise): with spinning OpenMP
  workers the trainer's probe forward and the broadcast compete for the cores, several times slower.

Ratios: broadcast efficiency = swap-time bandwidth of the 0.5B broadcast without verification / gloo
bandwidth (preallocated receive; target >= 0.70; the same with the verifying publisher is reported
too); verify / swap for both models (target <= 0.10). Figures
are medians over the timed repeats. Usage: `python benchmarks/weight_sync.py [--quick]` (`--quick`:
a 64 MiB tensor, a ~0.05B model, fewer repeats). Prints a table, then `RESULT {...}` for `arl bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
EFFICIENCY_TARGET = 0.70
VERIFY_TARGET = 0.10
TIMEOUT_S = 300.0
RECEIVE_MODES = ("preallocated", "fresh")
WARMUP = 2  # broadcast publications before the timed ones (see the module docstring)


@dataclass
class Sizes:
    tensor_mib: int
    bandwidth_repeats: int
    publish_repeats: int
    layers: int
    hidden: int
    vocab: int


FULL = Sizes(tensor_mib=256, bandwidth_repeats=6, publish_repeats=5, layers=30, hidden=1024, vocab=32768)
QUICK = Sizes(tensor_mib=64, bandwidth_repeats=3, publish_repeats=2, layers=12, hidden=512, vocab=8192)


@dataclass
class Runs:
    """One transport's timed publications (seconds, one entry per version)."""

    wall: list[float] = field(default_factory=list)
    """`publish()` as the trainer waits for it: pause, move, verify (with the trainer's reference forward), resume."""
    sync: list[float] = field(default_factory=list)
    """`PublishReport.sync_s`: pause and move the tensors."""
    verify: list[float] = field(default_factory=list)
    """`PublishReport.verify_s`: the servers' probe and weight-sample checks."""

    def add(self, wall: float, report: Any) -> None:
        if not report.servers:
            raise RuntimeError(f"version {report.version} verified on no server: {report}")
        self.wall.append(wall)
        self.sync.append(report.sync_s)
        self.verify.append(report.verify_s)


@dataclass
class Publication:
    """Timings of one model's publications."""

    label: str
    params: int
    bytes_sent: int
    broadcast_first_s: float = 0.0
    broadcast: Runs = field(default_factory=Runs)
    unverified: Runs = field(default_factory=Runs)
    """Broadcast with `trainer.verify: false`: the transport alone (on 2 cores the verifying publisher's
    reference forward, which overlaps the transfer, competes with gloo for the CPU)."""
    disk: Runs = field(default_factory=Runs)
    checkpoint_s: list[float] = field(default_factory=list)


# -- gloo bandwidth ----------------------------------------------------------------------------------
def gloo_bandwidth(tensor_mib: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per broadcast of `tensor_mib` MiB fp32 from this process (rank 0) to a receiver process, by how
    the receiver receives: `fresh` (`receive_from_trainer`: a new tensor each time, as the server does) and
    `preallocated` (one tensor received into again and again: the transport alone)."""
    import torch
    import torch.distributed as dist

    from pipeline.engine.weight_group import broadcast_from_trainer, destroy_weight_group, init_weight_group
    from pipeline.net.addresses import free_port

    port = free_port("127.0.0.1")
    argv = [sys.executable, __file__, "--receive", str(port), str(tensor_mib), str(repeats + 1)]
    receiver = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        group = init_weight_group("127.0.0.1", port, rank=0, world_size=2, group_name="bench-bandwidth",
                                  backend="gloo", timeout_s=120)  # fmt: skip
        tensor = torch.randn(tensor_mib * 2**20 // 4)
        ack = torch.zeros(1, dtype=torch.uint8)
        times: dict[str, list[float]] = {mode: [] for mode in RECEIVE_MODES}
        for _ in range(repeats + 1):  # the first round warms the connection up; modes alternate against drift
            for mode in RECEIVE_MODES:
                start = time.perf_counter()
                broadcast_from_trainer(group, [tensor])
                dist.broadcast(ack, src=1, group=group)
                times[mode].append(time.perf_counter() - start)
        destroy_weight_group(group)
        if receiver.wait(timeout=60) != 0:
            raise RuntimeError(f"the bandwidth receiver exited with {receiver.returncode}")
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return {mode: t[1:] for mode, t in times.items()}


def receive(port: int, tensor_mib: int, rounds: int) -> None:
    """The receiver process of `gloo_bandwidth` (rank 1): each round one receive per mode, each acknowledged."""
    import torch
    import torch.distributed as dist

    from pipeline.engine.weight_group import destroy_weight_group, init_weight_group, receive_from_trainer

    group = init_weight_group("127.0.0.1", port, rank=1, world_size=2, group_name="bench-bandwidth",
                              backend="gloo", timeout_s=120)  # fmt: skip
    numel = tensor_mib * 2**20 // 4
    buffer = torch.zeros(numel)
    for _ in range(rounds):
        for mode in RECEIVE_MODES:
            if mode == "fresh":
                receive_from_trainer(group, ["float32"], [[numel]], "cpu")
            else:
                dist.broadcast(buffer, src=0, group=group)
            dist.broadcast(torch.ones(1, dtype=torch.uint8), src=1, group=group)
    destroy_weight_group(group)


# -- models and the server ---------------------------------------------------------------------------
def build_models(workdir: Path, sizes: Sizes) -> dict[str, Path]:
    from pipeline.demo.tiny_model import make_tiny_model

    tiny = make_tiny_model(workdir / "tiny")
    large = make_tiny_model(workdir / "large", num_layers=sizes.layers, hidden_size=sizes.hidden,
                            vocab_size=sizes.vocab)  # fmt: skip
    return {"tiny": tiny, "large": large}


def start_server(model_dir: Path, port: int, log: Path, timeout_s: float = 600.0) -> subprocess.Popen[bytes]:
    import httpx

    argv = [sys.executable, "-m", "pipeline.engine.server.hf.process", "--model-path", str(model_dir), "--host",
            "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32", "--max-batch-size", "8",
            "--weight-version", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    handle = open(log, "wb")  # noqa: SIM115 - the child owns it until it exits
    proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"hf server exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"hf server not healthy after {timeout_s:.0f}s; log {log}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- publication -------------------------------------------------------------------------------------
def timed_publish(publisher: Any, version: int, checkpoint: Path | None, state_dict: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    report = publisher.publish(version, checkpoint, state_dict)
    return time.perf_counter() - start, report


def publish_model(name: str, model_dir: Path, workdir: Path, repeats: int) -> Publication:
    import torch

    from pipeline.engine.registry import write_entry
    from pipeline.engine.server.weights import read_checkpoint
    from pipeline.net.addresses import free_port
    from pipeline.run.paths import RunPaths
    from pipeline.trainer.checkpoint import save_checkpoint
    from pipeline.trainer.publish.publisher import PublishOptions, make_publisher
    from schemas.engine_api import InferenceEntry

    tied = bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    state_dict = read_checkpoint(model_dir)
    params = sum(t.numel() for t in state_dict.values())
    sent = sum(t.numel() * t.element_size() for k, t in state_dict.items() if not (tied and k == "lm_head.weight"))
    label = name if name == "tiny" else f"{params / 1e9:.{1 if params >= 1e8 else 2}f}b"
    pub = Publication(label=label, params=params, bytes_sent=sent)
    paths = RunPaths(workdir / f"run-{name}")
    options = PublishOptions(verify_model=model_dir, dtype="float32")  # what trainer.verify=true gives
    port = free_port("127.0.0.1")
    server = start_server(model_dir, port, workdir / f"server-{name}.log")
    try:
        write_entry(paths, "hf-0", InferenceEntry(url=f"http://127.0.0.1:{port}", backend="hf",
                                                  model_path=str(model_dir), weight_version=0, host="127.0.0.1",
                                                  pid=server.pid, started_at=time.time()))  # fmt: skip
        version = 0
        with torch.no_grad():
            publisher = make_publisher("nccl", paths, TIMEOUT_S, tied, options)
            try:
                for i in range(WARMUP + repeats):
                    version += 1
                    wall, report = timed_publish(publisher, version, None, state_dict)
                    if i == 0:  # builds the group: reported apart
                        pub.broadcast_first_s = wall
                    elif i >= WARMUP:
                        pub.broadcast.add(wall, report)
            finally:
                publisher.close()
            publisher = make_publisher("nccl", paths, TIMEOUT_S, tied, PublishOptions())  # no verification
            try:
                for i in range(1 + repeats):
                    version += 1
                    wall, report = timed_publish(publisher, version, None, state_dict)
                    if i >= 1:  # the first builds the group
                        pub.unverified.add(wall, report)
            finally:
                publisher.close()
            publisher = make_publisher("disk", paths, TIMEOUT_S, tied, options)
            try:
                for _ in range(repeats):
                    version += 1
                    start = time.perf_counter()
                    checkpoint = save_checkpoint(paths, version, state_dict, model_dir)
                    pub.checkpoint_s.append(time.perf_counter() - start)
                    pub.disk.add(*timed_publish(publisher, version, checkpoint, None))
                    shutil.rmtree(checkpoint)  # one checkpoint on disk at a time
            finally:
                publisher.close()
    finally:
        stop(server)
    return pub


# -- report ------------------------------------------------------------------------------------------
def summarize(bandwidth_s: dict[str, list[float]], tensor_mib: int, pubs: list[Publication]) -> dict[str, Any]:
    gloo = {mode: tensor_mib * 2**20 / statistics.median(t) / 1e9 for mode, t in bandwidth_s.items()}
    figures: dict[str, Any] = {
        "gloo broadcast GB/s (preallocated receive)": round(gloo["preallocated"], 3),
        "gloo broadcast GB/s (receive_from_trainer, fresh tensor)": round(gloo["fresh"], 3),
    }
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    for pub in pubs:
        bc, disk, name = pub.broadcast, pub.disk, pub.label
        swap, verify, wall = statistics.median(bc.sync), statistics.median(bc.verify), statistics.median(bc.wall)
        figures.update({
            f"{name} params (M)": round(pub.params / 1e6, 1),
            f"{name} MB sent": round(pub.bytes_sent / 1e6, 1),
            f"{name} broadcast first publish s (with group setup)": round(pub.broadcast_first_s, 3),
            f"{name} broadcast publish s (wall)": round(wall, 3),
            f"{name} broadcast swap s": round(swap, 3),
            f"{name} broadcast verify s": round(verify, 3),
            f"{name} broadcast effective GB/s": round(pub.bytes_sent / swap / 1e9, 3),
            f"{name} checkpoint write s": round(statistics.median(pub.checkpoint_s), 3),
            f"{name} disk publish s (wall)": round(statistics.median(disk.wall), 3),
            f"{name} disk swap s": round(statistics.median(disk.sync), 3),
            f"{name} disk verify s": round(statistics.median(disk.verify), 3),
        })  # fmt: skip
        ratios[f"{name} broadcast verify / swap"] = round(verify / swap, 3)
        ratios[f"{name} broadcast (wall - swap) / swap"] = round((wall - swap) / swap, 3)
        key = f"{name} broadcast verify / swap <= {VERIFY_TARGET:.2f}"
        targets[key] = "met" if verify / swap <= VERIFY_TARGET else f"missed ({verify / swap:.2f})"
    large = pubs[-1]
    verifying = large.bytes_sent / statistics.median(large.broadcast.sync) / 1e9 / gloo["preallocated"]
    ratios[f"{large.label} broadcast effective (verifying publisher) / gloo"] = round(verifying, 3)
    unverified = statistics.median(large.unverified.sync)
    figures[f"{large.label} broadcast swap s (trainer.verify false)"] = round(unverified, 3)
    efficiency = large.bytes_sent / unverified / 1e9 / gloo["preallocated"]
    ratios[f"{large.label} broadcast effective / gloo (preallocated receive)"] = round(efficiency, 3)
    key = f"{large.label} broadcast effective / gloo (preallocated receive) >= {EFFICIENCY_TARGET:.2f}"
    targets[key] = "met" if efficiency >= EFFICIENCY_TARGET else f"missed ({efficiency:.2f})"
    return {"figures": figures, "ratios": ratios, "targets": targets}


def report(summary: dict[str, Any]) -> None:
    width = max(len(k) for k in [*summary["figures"], *summary["ratios"], *summary["targets"]]) + 10
    for k, v in summary["figures"].items():
        print(f"{k:<{width}}{v}")
    for k, v in summary["ratios"].items():
        print(f"{'ratio: ' + k:<{width}}{v}")
    for k, v in summary["targets"].items():
        print(f"{'target: ' + k:<{width}}{v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 64 MiB tensor, a ~0.05B model, fewer repeats")
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir, removed after)")
    parser.add_argument("--receive", nargs=3, type=int, help=argparse.SUPPRESS)  # the bandwidth receiver
    args = parser.parse_args()
    if args.receive:
        receive(*args.receive)
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see hf.main)
    sizes = QUICK if args.quick else FULL
    workdir = Path(tempfile.mkdtemp(prefix="arl-weight-sync-bench-", dir=args.dir))
    try:
        print(f"gloo broadcast: {sizes.tensor_mib} MiB fp32 x {sizes.bandwidth_repeats}, before and after", flush=True)
        bandwidth_s = gloo_bandwidth(sizes.tensor_mib, sizes.bandwidth_repeats)
        print("building the models", flush=True)
        models = build_models(workdir, sizes)
        pubs = []
        for name, model_dir in models.items():
            print(f"publishing {name}: broadcast {WARMUP} + {sizes.publish_repeats}, disk {sizes.publish_repeats}",
                  flush=True)  # fmt: skip
            pubs.append(publish_model(name, model_dir, workdir, sizes.publish_repeats))
        # Measured again after the publications: the machine's background load drifts over minutes.
        for mode, times in gloo_bandwidth(sizes.tensor_mib, sizes.bandwidth_repeats).items():
            bandwidth_s[mode] += times
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(bandwidth_s, sizes.tensor_mib, pubs)
    report(summary)
    reference = (f"gloo broadcast of a {sizes.tensor_mib} MiB fp32 tensor to one receiver process over loopback, "
                 "same run (preallocated receive: the ceiling of the broadcast swap); each model's swap time "
                 "(PublishReport.sync_s) for its verification time" + (" (--quick)" if args.quick else ""))  # fmt: skip
    print("RESULT " + json.dumps({"name": "weight_sync", **summary, "reference": reference}))


if __name__ == "__main__":
    main()
