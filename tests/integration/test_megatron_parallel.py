"""Tensor, pipeline and data parallelism over gloo (two real processes) equal one process.

Each layout (tp=2, pp=2, dp=2) trains one minibatch of the same synthetic step from the same tiny Qwen2
checkpoint; the loop's per-rank plan (`plan_step(rank, world_size)`) is used exactly as the trainer loop
would. Against a single-process run: every rank's log-probs, the loss summed over ranks (as the loop
sums), the global grad norm and the updated HF weights gathered on rank 0. Also: each rank writes its
optimizer shard into rank 0's staging directory.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def _config(model_dir: Path, root: Path, tp: int, pp: int) -> Any:
    from pipeline.run.config import load_config

    return load_config(None, [f"fileroot={root}", "experiment_name=x", "trial_name=y", f"model.path={model_dir}",
                              "trainer.device=cpu", "trainer.optimizer.lr=0.01", "trainer.optimizer.eps=0.001",
                              f"trainer.megatron.tp={tp}",
                              f"trainer.megatron.pp={pp}"])  # fmt: skip


def _plan(rows: list[dict], config: Any, rank: int, world: int) -> list:
    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.data import rows_to_samples
    from pipeline.trainer.packing import plan_step

    samples = rows_to_samples(rows)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples],
                             config.trainer.algorithm.advantage)  # fmt: skip
    return plan_step(samples, adv, minibatches=1, budget=40, agg="token", seed=0, step=0, rank=rank,
                     world_size=world)[0]  # fmt: skip


def _one_step(config: Any, model_dir: Path, rows: list[dict], state_dir: Path | None) -> dict[str, Any]:
    """What one rank observes: log-probs of its micro-batches, the update's stats, rank 0's new weights."""
    from pipeline.trainer.losses import policy_loss
    from pipeline.trainer.megatron.megatron_backend import MegatronBackend

    algo = config.trainer.algorithm

    def loss_fn(logp, entropy, batch):  # type: ignore[no-untyped-def]
        return policy_loss(logp, entropy, dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask), algo)

    backend = MegatronBackend(config, total_updates=4)
    try:
        backend.load(model_dir, None)
        micros = _plan(rows, config, backend.rank, backend.world_size)
        logp = [backend.logprobs(m) for m in micros]
        stats = backend.train_minibatch(micros, loss_fn)
        weights = backend.hf_state_dict()
        if state_dir is not None:
            backend.save_state(state_dir if backend.rank == 0 else Path(os.devnull))
        return {"logp": logp, "loss": stats.loss, "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                "weights": weights, "rank": backend.rank}  # fmt: skip
    finally:
        backend.close()


def _worker(rank: int, ports: dict[str, int], model_dir: Path, rows: list[dict], out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    for name, (tp, pp) in LAYOUTS.items():
        if name not in ports:
            continue
        os.environ["MASTER_PORT"] = str(ports[name])
        state_dir = out / f"{name}-state"
        state_dir.mkdir(exist_ok=True)
        result = _one_step(_config(model_dir, out, tp, pp), model_dir, rows, state_dir)
        torch.save(result, out / f"{name}-rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_tp_pp_dp_over_gloo_equal_one_process(model: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Qwen3 runs tp=2 only: what it adds over Qwen2 is its per-head q/k norms, whose gradient each TP rank holds
    a part of (the layouts without TP do not split heads)."""
    import torch.multiprocessing as mp

    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows

    tiny_model_dir = Path(request.getfixturevalue("tiny_model_dir" if model == "qwen2" else "tiny_qwen3_dir"))
    layouts = list(LAYOUTS) if model == "qwen2" else ["tp2"]
    rows = add_behaviour_logprobs(synthetic_rows(0, num_groups=3, completion_lens=[5, 9, 13]), tiny_model_dir)
    ports = {name: _free_port() for name in layouts}
    mp.start_processes(_worker, args=(ports, tiny_model_dir, rows, tmp_path), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip

    reference = _one_step(_config(tiny_model_dir, tmp_path, 1, 1), tiny_model_dir, rows, None)
    ref_cfg = _config(tiny_model_dir, tmp_path, 1, 1)
    with _single_rank_logprobs(tiny_model_dir, ref_cfg) as logprobs:
        for name in layouts:
            ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
            for r, got in enumerate(ranks):
                expected = [logprobs(m) for m in _plan(rows, ref_cfg, r, 2)]
                assert len(got["logp"]) == len(expected) >= 2, name
                for a, b in zip(got["logp"], expected, strict=True):
                    assert (a - b).abs().max().item() < 1e-5, name
            assert sum(r["loss"] for r in ranks) == pytest.approx(reference["loss"], abs=1e-6), name
            assert sum(r["tokens"] for r in ranks) == reference["tokens"], name
            for got in ranks:
                assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
            weights = ranks[0]["weights"]
            assert not ranks[1]["weights"] and sorted(weights) == sorted(reference["weights"]), name
            for key, value in reference["weights"].items():
                # eps=1e-3 keeps Adam's first step (lr * g / (|g| + eps)) from amplifying float noise in
                # near-zero gradients; then the updated weights agree to float precision.
                assert (weights[key] - value).abs().max().item() < 1e-6, (name, key)
            shards = sorted(p.name for p in (tmp_path / f"{name}-state").iterdir())
            assert shards == ["megatron_layout.json", "optimizer_rank00000.pt", "optimizer_rank00001.pt",
                              "scheduler.pt"], name  # fmt: skip


class _single_rank_logprobs:
    """A tp=1 megatron backend in this process whose `logprobs` is the reference for every micro-batch."""

    def __init__(self, model_dir: Path, config: Any) -> None:
        from pipeline.trainer.megatron.megatron_backend import MegatronBackend

        self.backend = MegatronBackend(config, total_updates=1)
        self.backend.load(model_dir, None)

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self.backend.logprobs

    def __exit__(self, *exc: object) -> None:
        self.backend.close()
