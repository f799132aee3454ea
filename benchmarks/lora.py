"""LoRA versus full-weight training on the ~0.5B random model, CPU: memory, step time, checkpoints, merging.

Each configuration (full weights; `trainer.lora` rank 16, alpha 32, all-linear, the defaults; rank 64,
alpha 128) runs in a fresh process of its own (`--worker`), so its peak memory is its own: the real
`TorchBackend` (`load`, then `train_minibatch` with the loop's decoupled policy loss) on a random-init
model of Qwen2.5-0.5B's shapes (`train_throughput.QWEN_05B`, tied embeddings, fp32), the same batch of
random tokens for every configuration (`--seqs` sequences of `--seq-len` tokens, 30 % prompt, one
micro-batch). Figures per configuration:

* memory: peak RSS of the process up to the end of the steps (`ru_maxrss`, model load included: the
  weights are memory-mapped, so the load itself stays small) and at the very end (after the export and
  the checkpoint writes below); the bytes of the parameters, the gradients and the AdamW state after the
  last step. The rest of the peak is activations (the 152k-entry vocabulary's logits are 0.6 GB per
  1024 tokens in fp32, and several copies live through the loss) and allocator slack.
* step time: median wall and CPU seconds of `--steps` optimizer updates after one warm-up update (forward,
  backward, clip, AdamW); CPU seconds move less with a shared machine's load. The trainable parameter count.
* checkpoints, written by the trainer's own code: full weights = `checkpoint.save_checkpoint` of
  `hf_state_dict()`; LoRA = `lora.save_checkpoint` with the adapter alone (PEFT's format, what
  `publish: adapter` keeps) and with `merged/` too (what `publish: merged` writes today); each with the
  trainer state `save_state` writes (the optimizer state). Directory sizes in bytes.
* merging (LoRA): `lora.merged_weights` on the gathered state dict, the arithmetic merged publication pays
  every version, and `hf_state_dict()` as a whole (gather + merge) against the full model's (gather only).

No targets: the figures size the trade-off (docs/trainer.md, "LoRA"). Ratios compare each LoRA
configuration with the full-weight one of the same run. The configurations run one after another, so a
shared machine's load can drift between them: the step-time ratios carry that noise.

* publication (`_lora_publish.py`): one LoRA version (the first rank) published to a real `hf` engine serving
  the model, by the trainer's `Publisher` with verification, as `publish: adapter` (the adapter checkpoint,
  `/load_lora_adapter`) and as `publish: merged` (the checkpoint with `merged/`, `/update_weights_from_disk`):
  checkpoint write seconds, publish seconds (send + verify) and the bytes the server reads.

Sections: `run` fills one results dict, one function per figure group (`measure` in each worker for the
training-side groups); a new group is one more function whose figures go into that dict and `summarize`.

Usage: `python benchmarks/lora.py [--seqs 4] [--seq-len 256] [--steps 3] [--ranks 16 64] [--small]`
(`--small`: a ~10M model of the same architecture, for a quick check). Prints a table, then one
`RESULT {...}` line for `arl bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as `python benchmarks/lora.py`: the root, for `benchmarks.` imports
from benchmarks._lora_publish import publication_figures  # noqa: E402
from benchmarks.train_throughput import QWEN_05B, SMALL  # noqa: E402

FULL = "full"
WORKER_TAG = "WORKER "
TIMEOUT_S = 1800.0


@dataclass
class Spec:
    """One configuration measured in one process."""

    label: str
    """`full`, or `lora rN`."""
    model_dir: str
    workdir: str
    seqs: int
    seq_len: int
    steps: int
    rank: int = 0
    """LoRA rank; 0 = full weights."""

    def overrides(self) -> list[str]:
        budget = self.seqs * self.seq_len  # one micro-batch: the whole batch in one forward
        out = [f"model.path={self.model_dir}", f"trainer.micro_batch_tokens={budget}", "trainer.device=cpu"]
        if self.rank:  # alpha = 2 x rank, as the default rank 16 / alpha 32
            out += [f"trainer.lora.rank={self.rank}", f"trainer.lora.alpha={2 * self.rank}"]
        return out


# -- memory ------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(backend: Any) -> dict[str, int]:
    """Bytes of the parameters (all, and those that train), their gradients and the optimizer's state."""
    import torch

    params = list(backend.model.parameters())
    state = [t for s in backend.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return {"param_bytes": nbytes(params), "trainable_bytes": nbytes(p for p in params if p.requires_grad),
            "grad_bytes": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_bytes": nbytes(state)}  # fmt: skip


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- one configuration (a worker process) ------------------------------------------------------------
def make_samples(n: int, length: int, vocab: int, seed: int = 0) -> list[Any]:
    """`n` rows of `length` random tokens, 30 % prompt, behaviour log-probs and rewards in one GRPO group."""
    import numpy as np

    from pipeline.trainer.data import rows_to_samples

    rng = np.random.default_rng(seed)
    prompt = int(length * 0.3)
    mask = [0] * prompt + [1] * (length - prompt)
    rows = [{"sample_id": str(i), "group_id": "0", "input_ids": rng.integers(0, vocab, length).tolist(),
             "loss_mask": mask, "logprobs": [-1.5 * m for m in mask], "versions": [0 if m else -1 for m in mask],
             "reward": float(i % 2)} for i in range(n)]  # fmt: skip
    return rows_to_samples(rows)


def train_figures(spec: Spec, backend: Any) -> dict[str, Any]:
    """Step times over the same batch, the memory they take, and the trainable parameter count."""
    import dataclasses

    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.losses import policy_loss
    from pipeline.trainer.packing import plan_step

    algo = backend.config.trainer.algorithm
    vocab = backend.model.config.vocab_size
    samples = make_samples(spec.seqs, spec.seq_len, vocab)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples], "grpo")
    plan = plan_step(samples, adv, minibatches=1, budget=spec.seqs * spec.seq_len, agg=algo.loss_agg, seed=0,
                     step=0, layout=backend.layout)  # fmt: skip

    def loss_fn(logp: Any, entropy: Any, batch: Any) -> Any:  # the loop's: one minibatch, proximal = current
        return policy_loss(logp, entropy, dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask), algo)

    times, cpu_times = [], []
    for _ in range(1 + spec.steps):  # the first warms up (allocator, optimizer state) and is not counted
        start, cpu_start = time.perf_counter(), time.process_time()
        backend.train_minibatch(plan[0], loss_fn)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    return {"params": backend.num_params, "trainable_params": trainable, "micro_batches": len(plan[0]),
            "step_s": statistics.median(times[1:]), "step_cpu_s": statistics.median(cpu_times[1:]),
            "warmup_step_s": times[0], "peak_rss_train": peak_rss_bytes(), **tensor_bytes(backend)}  # fmt: skip


def export_figures(spec: Spec, backend: Any) -> dict[str, Any]:
    """`hf_state_dict()` (for LoRA: gather + merge) and `lora.merged_weights` alone, timed."""
    from pipeline.trainer import fsdp, lora

    start = time.perf_counter()
    backend.hf_state_dict()
    out: dict[str, Any] = {"hf_state_dict_s": time.perf_counter() - start}
    if spec.rank:
        gathered = fsdp.full_state_dict(backend.model, 1)
        start = time.perf_counter()
        lora.merged_weights(gathered, lora.scaling(backend.model))
        out["merge_s"] = time.perf_counter() - start
    return out


def checkpoint_figures(spec: Spec, backend: Any) -> dict[str, Any]:
    """Bytes (and write seconds) of the checkpoints the trainer writes for this configuration, and of its state."""
    from pipeline.run.paths import RunPaths
    from pipeline.trainer import checkpoint, lora

    paths = RunPaths(Path(spec.workdir) / f"run-{spec.label.replace(' ', '-')}")
    model_dir, dtype = Path(spec.model_dir), backend.config.model.dtype
    state = backend.hf_state_dict()
    out: dict[str, Any] = {}

    def write(name: str, version: int, fill: Any) -> None:
        start = time.perf_counter()
        path = fill(version)
        out[f"{name}_write_s"] = time.perf_counter() - start
        out[f"{name}_bytes"] = dir_bytes(path)
        shutil.rmtree(path)  # one checkpoint on disk at a time

    if spec.rank:
        adapter, config = backend.adapter_state_dict(), backend.adapter_config()
        alone, merged = lora.AdapterCheckpoint(adapter, config), lora.AdapterCheckpoint(adapter, config, state)
        write("adapter_checkpoint", 1, lambda v: lora.save_checkpoint(paths, v, alone, model_dir, None, dtype))
        write("merged_checkpoint", 2, lambda v: lora.save_checkpoint(paths, v, merged, model_dir, None, dtype))
    else:
        write("full_checkpoint", 1, lambda v: checkpoint.save_checkpoint(paths, v, state, model_dir, None, dtype))
    state_dir = Path(spec.workdir) / f"state-{spec.label.replace(' ', '-')}"
    state_dir.mkdir()
    backend.save_state(state_dir)
    out["trainer_state_bytes"] = dir_bytes(state_dir)
    shutil.rmtree(state_dir)
    return out


def measure(spec: Spec) -> dict[str, Any]:
    """Every figure of one configuration, in this process: load, train, export, checkpoints."""
    from pipeline.run.config import load_config
    from pipeline.trainer.factory import make_backend

    backend: Any = make_backend(load_config(None, spec.overrides()), total_updates=100)
    try:
        start = time.perf_counter()
        backend.load(Path(spec.model_dir), None)
        figures: dict[str, Any] = {"load_s": time.perf_counter() - start}
        figures.update(train_figures(spec, backend))
        figures.update(export_figures(spec, backend))
        figures.update(checkpoint_figures(spec, backend))
        figures["peak_rss_end"] = peak_rss_bytes()  # with the exported state dicts and checkpoint writes
        return figures
    finally:
        backend.close()


def run_worker(spec: Spec) -> dict[str, Any]:
    """`measure(spec)` in a fresh process, so that its peak RSS is that configuration's alone."""
    argv = [sys.executable, __file__, "--worker", json.dumps(asdict(spec))]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    found = [line for line in proc.stdout.splitlines() if line.startswith(WORKER_TAG)]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"worker {spec.label} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(found[-1][len(WORKER_TAG) :])  # type: ignore[no-any-return]


def build_model(out: Path, small: bool, max_len: int) -> None:
    """The random model, built in a child process so that this one stays small."""
    code = ("import sys, json; from pathlib import Path; from benchmarks.train_throughput import make_model; "
            "make_model(Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]))")  # fmt: skip
    argv = [sys.executable, "-c", code, str(out), json.dumps(SMALL if small else QWEN_05B), str(max_len)]
    subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=True,
                   timeout=TIMEOUT_S)  # fmt: skip


# -- the run and its report --------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """The results dict: {"configs": {label: figures}, "model_bytes": ...}; one entry per figure group."""
    workdir = Path(tempfile.mkdtemp(prefix="arl-lora-bench-", dir=args.dir))
    try:
        model_dir = workdir / "model"
        print(f"building the {'small' if args.small else '~0.5B'} random model", flush=True)
        build_model(model_dir, args.small, args.seq_len)
        results: dict[str, Any] = {"model_bytes": dir_bytes(model_dir), "configs": {}}
        for rank in [0, *args.ranks]:
            spec = Spec(FULL if rank == 0 else f"lora r{rank}", str(model_dir), str(workdir), args.seqs, args.seq_len,
                        args.steps, rank)  # fmt: skip
            print(f"measuring {spec.label}: 1 + {spec.steps} steps of {spec.seqs} x {spec.seq_len} tokens", flush=True)
            results["configs"][spec.label] = run_worker(spec)
        if args.publish:
            print(f"publishing one LoRA r{args.ranks[0]} version to an hf engine: adapter, then merged", flush=True)
            results["publication"] = publication_figures(model_dir, workdir, args.ranks[0])
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def _state_bytes(c: dict[str, Any]) -> int:
    return int(c["param_bytes"] + c["grad_bytes"] + c["optimizer_bytes"])


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Figures, ratios (each LoRA configuration against full weights) and the reference, for RESULTS.md."""
    configs = results["configs"]
    full = configs[FULL]
    figures: dict[str, Any] = {"batch": f"{args.seqs} x {args.seq_len} tokens", "timed steps": args.steps,
                               "params (M)": round(full["params"] / 1e6, 1),
                               "base model MB on disk": round(results["model_bytes"] / 1e6, 1)}  # fmt: skip
    ratios: dict[str, float] = {}
    for label, c in configs.items():
        figures.update({
            f"{label} trainable params (M)": round(c["trainable_params"] / 1e6, 3),
            f"{label} peak RSS GiB (load + steps)": _gib(c["peak_rss_train"]),
            f"{label} params + grads + AdamW state GiB": _gib(_state_bytes(c)),
            f"{label} grads GiB": _gib(c["grad_bytes"]),
            f"{label} AdamW state GiB": _gib(c["optimizer_bytes"]),
            f"{label} step s (median)": round(c["step_s"], 2),
            f"{label} step CPU s (median)": round(c["step_cpu_s"], 2),
            f"{label} warm-up step s": round(c["warmup_step_s"], 2),
            f"{label} hf_state_dict s": round(c["hf_state_dict_s"], 3),
            f"{label} trainer state MB": round(c["trainer_state_bytes"] / 1e6, 3),
            f"{label} peak RSS GiB (with export and checkpoints)": _gib(c["peak_rss_end"]),
        })  # fmt: skip
        if label == FULL:
            figures["full checkpoint MB"] = round(c["full_checkpoint_bytes"] / 1e6, 1)
            figures["full checkpoint write s"] = round(c["full_checkpoint_write_s"], 2)
            continue
        figures.update({
            f"{label} merge s (lora.merged_weights)": round(c["merge_s"], 3),
            f"{label} adapter checkpoint MB": round(c["adapter_checkpoint_bytes"] / 1e6, 3),
            f"{label} adapter checkpoint write s": round(c["adapter_checkpoint_write_s"], 3),
            f"{label} checkpoint with merged/ MB": round(c["merged_checkpoint_bytes"] / 1e6, 1),
            f"{label} checkpoint with merged/ write s": round(c["merged_checkpoint_write_s"], 2),
        })  # fmt: skip
        ratios.update({
            f"{label} / full peak RSS (load + steps)": round(c["peak_rss_train"] / full["peak_rss_train"], 3),
            f"{label} / full params + grads + AdamW state": round(_state_bytes(c) / _state_bytes(full), 4),
            f"{label} / full step time": round(c["step_s"] / full["step_s"], 3),
            f"{label} / full step CPU time": round(c["step_cpu_s"] / full["step_cpu_s"], 3),
            f"{label} / full trainable params": round(c["trainable_params"] / full["trainable_params"], 5),
            f"{label} adapter checkpoint / full checkpoint bytes": round(
                c["adapter_checkpoint_bytes"] / full["full_checkpoint_bytes"], 5),
            f"{label} trainer state / full trainer state bytes": round(
                c["trainer_state_bytes"] / full["trainer_state_bytes"], 5),
            f"{label} merge / its step time": round(c["merge_s"] / c["step_s"], 3),
        })  # fmt: skip
    publication = results.get("publication")
    if publication:
        figures.update(
            {f"publication: {k}": round(v, 3) if "bytes" not in k else int(v) for k, v in publication.items()}
        )
        ratios["adapter / merged publication time (write + publish)"] = round(
            (publication["adapter checkpoint write s"] + publication["adapter publish s"])
            / (publication["merged checkpoint write s"] + publication["merged publish s"]),
            3,
        )
        ratios["adapter / merged bytes the server reads"] = round(
            publication["adapter bytes sent"] / publication["merged bytes sent"], 5
        )
    model = "a ~10M model (--small)" if args.small else "the ~0.5B random model (Qwen2.5-0.5B shapes, fp32)"
    reference = (f"full-weight training of {model} on CPU, same batch, same run, each configuration in its own "
                 "process; checkpoints: the full-weight checkpoint (checkpoint.save_checkpoint)")  # fmt: skip
    return {"name": "lora", "figures": figures, "ratios": ratios, "reference": reference}


def report(summary: dict[str, Any]) -> None:
    width = max(len(k) for k in [*summary["figures"], *summary["ratios"]]) + 10
    for k, v in summary["figures"].items():
        print(f"{k:<{width}}{v}")
    for k, v in summary["ratios"].items():
        print(f"{'ratio: ' + k:<{width}}{v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step (one micro-batch)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps after one warm-up step")
    parser.add_argument("--ranks", type=int, nargs="*", default=[16, 64], help="LoRA ranks (alpha = 2 x rank)")
    parser.add_argument("--small", action="store_true", help="a ~10M model of the same architecture (quick check)")
    parser.add_argument(
        "--no-publish",
        dest="publish",
        action="store_false",
        help="skip the publication group (one version to an hf engine, adapter vs merged)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir, removed after)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one configuration, in a fresh process
    args = parser.parse_args()
    if args.worker:
        print(WORKER_TAG + json.dumps(measure(Spec(**json.loads(args.worker)))), flush=True)
        return
    summary = summarize(run(args), args)
    report(summary)
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
