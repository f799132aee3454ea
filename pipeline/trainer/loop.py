"""The trainer loop. Step k: wait for trajectories/step_k → load and check → advantages → update →
checkpoint → publish version k+1 → log metrics. Resume starts from the newest version with a
complete checkpoint and trainer state; `--step N` redoes exactly step N from version N, then exits.
A step's metrics row is a `StepRow` (pipeline/trainer/step_row.py), held on disk from before the
checkpoint until it is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.errors import ArlError
from pipeline.eval.hold import hold_for_evaluation
from pipeline.run.handoff import read_json, wait_for
from pipeline.run.paths import RunPaths, step_name
from pipeline.run.stage import StageContext
from pipeline.run.weight_version import write_weight_version
from pipeline.trainer import checkpoint as ckpt
from pipeline.trainer import fsdp
from pipeline.trainer.advantages import compute_advantages, normalize_per_task
from pipeline.trainer.backend import MinibatchStats
from pipeline.trainer.data import StepData, load_step
from pipeline.trainer.factory import make_backend
from pipeline.trainer.losses import LossOutput, TokenBatch, policy_loss
from pipeline.trainer.metrics import Timings, open_sinks, peak_flops, step_metrics
from pipeline.trainer.packing import MicroBatch, plan_step
from pipeline.trainer.publish.publisher import PublishOptions, make_publisher
from pipeline.trainer.step_row import StepRow
from schemas.config import ArlConfig

if TYPE_CHECKING:
    from pipeline.trainer.torch_backend import TorchBackend

log = logging.getLogger("arl.trainer")


def run_trainer(ctx: StageContext) -> int:
    """The `train` stage: every remaining step of the run, or (with `ctx.only_step`) exactly that one step."""
    trainer = Trainer(ctx.config, ctx.paths, redo_step=ctx.only_step)
    try:
        if ctx.only_step is None:
            trainer.run()
        else:
            trainer.redo(ctx.only_step)
    finally:
        trainer.close()
    return 0


class Trainer:
    def __init__(self, config: ArlConfig, paths: RunPaths, *, redo_step: int | None = None) -> None:
        self.config, self.paths, self.cfg = config, paths, config.trainer
        seed_everything(self.cfg.seed, self.cfg.deterministic)
        self.backend = make_backend(config, total_updates=config.num_steps * self.cfg.minibatches)
        self.rank0 = self.backend.rank == 0
        self.sinks = open_sinks(config, paths, self.backend.rank, redo_step=redo_step)
        self.publisher = None
        if self.rank0:
            tied = bool(read_json(Path(config.model.path) / "config.json").get("tie_word_embeddings", False))
            self.publisher = make_publisher(
                self.cfg.weight_sync, paths, self.cfg.publish_timeout_s, tied, PublishOptions.from_config(config)
            )
        self.upstream = "proxy" if config.rollout.source == "external" else "rollout"
        self.peak: float | None = None
        self._state_dict: dict[str, torch.Tensor] | None = None
        """Full HF-named weights of the version being published (rank 0), shared by checkpoint and broadcast."""

    # -- entry points ---------------------------------------------------------------------------
    def run(self) -> None:
        if self.rank0:
            ckpt.clean_partial(self.paths)
        version = fsdp.broadcast_int(ckpt.resume_point(self.paths) if self.rank0 else 0)
        self.start_from(version)
        self.log_held_metrics(version, self.ensure_published(version))
        for step in range(version, self.config.num_steps):
            self.train_step(step)
        if self.rank0:  # the launcher ends the run when the trainer ends: the last evaluation first
            hold_for_evaluation(self.paths, self.config, self.config.num_steps)
        log.info("trained %d steps: version %d is the last", self.config.num_steps, self.config.num_steps)

    def redo(self, step: int) -> None:
        if not 0 <= step < self.config.num_steps:
            raise ArlError(f"--step {step} is outside the run's steps 0..{self.config.num_steps - 1}")
        if step > 0 and not (self.paths.checkpoint_marker(step).exists() and ckpt.state_complete(self.paths, step)):
            raise ArlError(
                f"--step {step} needs version {step}: {self.paths.checkpoint_dir(step)} and "
                f"{self.paths.trainer_state_dir(step)} must both be complete (pruned? raise trainer.keep_checkpoints)"
            )
        self.start_from(step)
        # A row a stopped run left is settled first (no publication of its own here): the redo's row takes the file.
        self.log_held_metrics(step, Timings())
        self.train_step(step, rerun=True)

    def close(self) -> None:
        self.sinks.close()
        if self.publisher is not None:
            self.publisher.close()
        self.backend.close()

    # -- one step: the table of contents --------------------------------------------------------
    def train_step(self, step: int, rerun: bool = False) -> None:
        timings = Timings()
        data = self.wait_and_load(step, timings)
        advantages = compute_advantages(
            [s.reward for s in data.samples], [s.group_id for s in data.samples], self.cfg.algorithm.advantage
        )
        if self.config.rollout.tasks and self.cfg.algorithm.task_normalize:
            advantages = normalize_per_task(advantages, [s.task for s in data.samples])
        plan = self.plan(data, advantages, step)
        updates = self.update(plan, timings)
        version = step + 1
        row = self.metrics_row(step, data, advantages, updates, timings)
        # Held before the checkpoint: once it is complete a resume starts past this step, so a trainer stopped
        # anywhere after it (a peer lost at its barrier, the publication) must have left this row behind.
        row.hold()
        checkpoint = self.maybe_checkpoint(version, timings, force=rerun)
        row.checkpointed(timings.checkpoint_s)
        if self.rank0 and not rerun:  # the engines keep version `step` until its in-run evaluation is recorded
            timings.eval_hold_s = hold_for_evaluation(self.paths, self.config, step)
        self.publish(version, checkpoint, timings)
        self.log_metrics(row, timings)

    # -- the steps ------------------------------------------------------------------------------
    def start_from(self, version: int) -> None:
        """Load weights of `version` (the initial model for 0) with the optimizer/RNG state saved with them."""
        weights = Path(self.config.model.path) if version == 0 else self.paths.checkpoint_dir(version)
        state = self.paths.trainer_state_dir(version) if ckpt.state_complete(self.paths, version) else None
        log.info("starting from version %d (%s)%s", version, weights, " with saved trainer state" if state else "")
        self.backend.load(weights, state)
        if state is not None:
            ckpt.load_rng(state)
        self.peak = peak_flops(getattr(self.backend, "device", torch.device("cpu")))

    def wait_and_load(self, step: int, timings: Timings) -> StepData:
        t0 = time.perf_counter()
        wait_for(
            self.paths.step_manifest(step),
            what=f"trajectories/{step_name(step)}/_MANIFEST.json",
            upstream=self.upstream,
            log=self.paths.latest_log(self.upstream),
            timeout_s=self.cfg.wait_timeout_s,
        )
        timings.wait_s = time.perf_counter() - t0
        by_task = bool(self.config.rollout.tasks) and self.cfg.algorithm.task_normalize
        data = load_step(self.paths, step, self.config.rollout.max_staleness, with_tasks=by_task)
        timings.load_s = time.perf_counter() - t0 - timings.wait_s
        return data

    def plan(self, data: StepData, advantages: np.ndarray, step: int) -> list[list[MicroBatch]]:
        return plan_step(
            data.samples,
            advantages,
            minibatches=self.cfg.minibatches,
            budget=self.cfg.micro_batch_tokens,
            agg=self.cfg.algorithm.loss_agg,
            seed=self.cfg.seed,
            step=step,
            rank=self.backend.rank,
            world_size=self.backend.world_size,
            layout=self.backend.layout,
        )

    def update(self, plan: list[list[MicroBatch]], timings: Timings) -> list[MinibatchStats]:
        """Proximal / reference log-probs with the weights of this version, then one update per minibatch."""
        t0 = time.perf_counter()
        algo = self.cfg.algorithm
        # With one minibatch the first forward of the update runs on exactly the proximal weights, so its
        # detached log-probs ARE the proximal ones: skip the extra forward pass.
        prox_from_current = algo.decoupled and len(plan) == 1
        for micro in (m for minibatch in plan for m in minibatch):
            if algo.decoupled and not prox_from_current:
                micro.tokens.prox_logp = self.backend.logprobs(micro) * micro.tokens.mask
            if algo.kl_coef > 0:
                micro.tokens.ref_logp = self.backend.logprobs(micro, reference=True) * micro.tokens.mask

        def loss_fn(logp: torch.Tensor, entropy: torch.Tensor | None, batch: TokenBatch) -> LossOutput:
            if prox_from_current:
                batch = dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask)
            return policy_loss(logp, entropy, batch, algo)

        updates = [reduce_stats(self.backend.train_minibatch(minibatch, loss_fn)) for minibatch in plan]
        timings.compute_s = time.perf_counter() - t0
        return updates

    def maybe_checkpoint(self, version: int, timings: Timings, force: bool = False) -> Path | None:
        """Trainer state, then the HF checkpoint, then `LATEST`; disk sync (and adapter publication, whose servers
        load the adapter from it) needs one every step."""
        due = (
            self.cfg.weight_sync == "disk"
            or self.cfg.publishes_adapters
            or force
            or version % self.cfg.checkpoint_every == 0
            or version == self.config.num_steps
        )
        self._state_dict = None
        if not due:
            if self.cfg.weight_sync == "nccl":
                self._state_dict = self.backend.hf_state_dict()
            return None
        t0 = time.perf_counter()
        self._state_dict = self.backend.hf_state_dict()
        staged = ckpt.stage_trainer_state(self.paths, version) if self.rank0 else Path(os.devnull)
        self.backend.save_state(staged)
        adapter = self._lora_backend().adapter_state_dict() if self.cfg.lora is not None else None
        if self.rank0:
            data = {"next_step": version, "seed": self.cfg.seed, "world_size": self.backend.world_size}
            ckpt.publish_state(self.paths, version, staged, data)
            self.save_weights(version, adapter)
            ckpt.prune(self.paths, self.cfg.keep_checkpoints, newest=version)
        fsdp.barrier()
        timings.checkpoint_s = time.perf_counter() - t0
        return self.paths.weights_dir(version)

    def _lora_backend(self) -> TorchBackend:
        from pipeline.trainer.torch_backend import TorchBackend

        assert isinstance(self.backend, TorchBackend), "trainer.lora is refused with another backend at validation"
        return self.backend

    def save_weights(self, version: int, adapter: dict[str, torch.Tensor] | None) -> None:
        """Rank 0: the HF checkpoint, or with LoRA the adapter and the merged model beside it (`trainer.lora`)."""
        assert self._state_dict is not None
        model, tokenizer, dtype = Path(self.config.model.path), _tokenizer_dir(self.config), self.config.model.dtype
        if adapter is None:
            ckpt.save_checkpoint(self.paths, version, self._state_dict, model, tokenizer, dtype)
            return
        from pipeline.trainer import lora

        config = self._lora_backend().adapter_config()
        merged = None if self.cfg.publishes_adapters else self._state_dict  # servers load the adapter alone
        written = lora.AdapterCheckpoint(adapter, config, merged)
        lora.save_checkpoint(self.paths, version, written, model, tokenizer, dtype)

    def publish(self, version: int, checkpoint: Path | None, timings: Timings) -> None:
        t0 = time.perf_counter()
        if self.publisher is not None:
            report = self.publisher.publish(version, checkpoint, self._state_dict)
            write_weight_version(self.paths, version, checkpoint if version > 0 else None)  # 0: the initial model
            servers = report.servers
            log.info("version %d published to %d server(s)%s", version, len(servers), f": {servers}" if servers else "")
            timings.weight_sync_s, timings.verify_s = report.sync_s, report.verify_s
            timings.servers_recovered = len(report.recovered)
        self._state_dict = None
        fsdp.barrier()
        timings.publish_s = time.perf_counter() - t0

    def ensure_published(self, version: int) -> Timings:
        """At start, publish the version resumed from (0: the initial model) to every registered server, even one
        already announced: it proves the servers hold what the trainer holds, and a trainer that died
        mid-publication left them paused, maybe half-updated, which only a verified publication ends."""
        if self.cfg.weight_sync == "nccl":
            self._state_dict = self.backend.hf_state_dict()  # collective: every rank takes part
        weights = self.paths.weights_dir(version) if version > 0 else Path(self.config.model.path)
        timings = Timings()
        self.publish(version, weights, timings)  # rank 0 publishes (disk: the verifier reads `weights`)
        return timings

    def metrics_row(
        self, step: int, data: StepData, advantages: np.ndarray, updates: list[MinibatchStats], timings: Timings
    ) -> StepRow:
        """The step's metrics row, computed (every rank: the log line; only rank 0 writes it anywhere)."""
        values = step_metrics(
            data,
            advantages,
            updates,
            timings,
            num_params=self.backend.num_params,
            world_size=self.backend.world_size,
            peak=self.peak,
            version=step + 1,
        )
        return StepRow(self.paths, self.sinks, step, values, writes=self.rank0)

    def log_held_metrics(self, version: int, timings: Timings) -> None:
        """At start: log the row an earlier attempt left between a checkpoint and its line when that step is
        finished (`StepRow.settle`; with the publication this trainer just made, if any); drop any other."""
        row = StepRow.left_behind(self.paths, self.sinks, writes=self.rank0)
        if row is not None:
            row.settle(version, timings)

    def log_metrics(self, row: StepRow, timings: Timings) -> None:
        """The row with the publication's figures to the sinks, then its held file removed; a line for people."""
        values = row.log(timings)
        row.clear()
        log.info(
            "step %d: loss %.4f reward %.3f grad_norm %.3f kl %.2e mismatch k3 %.2e %.0f tok/s (wait %.1fs "
            "compute %.1fs publish %.1fs)",
            row.step,
            values["loss"],
            values["reward_mean"],
            values["grad_norm"],
            values.get("kl_behav_k3", 0.0),
            values.get("mismatch/k3", 0.0),
            values["tokens_per_s"],
            timings.wait_s,
            timings.compute_s,
            timings.publish_s,
        )


def reduce_stats(stats: MinibatchStats) -> MinibatchStats:
    """Sum token statistics (and the loss shares) over data-parallel ranks; max the maxima; per-token values to
    rank 0 (the only rank that logs)."""
    summed = fsdp.all_reduce(
        {**{f"s.{k}": v for k, v in stats.sums.items()}, "loss": stats.loss, "tokens": float(stats.tokens)}
    )
    maxima = fsdp.all_reduce(stats.maxima, op="max")
    sums = {k.removeprefix("s."): v for k, v in summed.items() if k.startswith("s.")}
    return MinibatchStats(
        summed["loss"], stats.grad_norm, stats.lr, int(summed["tokens"]), sums, maxima, fsdp.gather_arrays(stats.values)
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def _tokenizer_dir(config: ArlConfig) -> Path | None:
    return Path(config.model.tokenizer) if config.model.tokenizer else None
