"""The `megatron` trainer backend: megatron-core GPTModel with tensor, pipeline and data parallelism.

It implements `pipeline.trainer.backend.TrainBackend` and shares everything else with the torch
backend: the loop hands it packed `MicroBatch`es and the shared `losses.policy_loss` (as `loss_fn`),
and takes back HF-named weights for checkpoints and publication.

Ranks. World = tp * pp * dp. The loop plans micro-batches per *rank* (`plan_step(rank, world_size)`),
while in megatron the tp * pp ranks of a model-parallel (MP) group must all run the SAME micro-batches.
So every collective method first shares the micro-batches of the whole MP group (`all_gather_object`,
a few KB of token ids) and runs all of them: each data-parallel replica processes exactly the union of
its members' rows, which are disjoint across replicas, so the step covers every row once with no
change to the loop's interface. Statistics are reported by one rank per MP group (last stage, tp 0)
and zero elsewhere, so the loop's world-wide sums count each row once; `logprobs` results travel back
from the last stage to the rank that asked.

Devices. CPU (CI): fp32 parameters, the CUDA shim, gloo, a torch AdamW over the local parameters with
gradients summed over data-parallel ranks and the global norm clipped across the MP group by hand
(megatron's optimizer and DDP hard-code CUDA). GPU: bf16 parameters (`trainer.bf16`) wrapped in
megatron's `DistributedDataParallel` (fp32 grad buffers) and megatron's mixed-precision optimizer
(fp32 master weights, its own clipping); `finalize_model_grads` syncs DP grads, sequence-parallel norm
grads and tied-embedding grads. The GPU path has not been run in this repository's CI (no GPU).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.trainer.backend import LossAccumulator, LossFn, MinibatchStats
from pipeline.trainer.checkpoint import save_torch
from pipeline.trainer.losses import logit_scale
from pipeline.trainer.lr_schedule import make_scheduler
from pipeline.trainer.megatron import parallel
from pipeline.trainer.megatron.forward import VocabShard, pack_inputs, token_logprobs
from pipeline.trainer.megatron.model import ModelDims, RunSettings, build_model, transformer_config
from pipeline.trainer.megatron.schedule import StageShape, forward_backward
from pipeline.trainer.megatron.transfer import gather_hf, load_hf_into
from pipeline.trainer.packing import MicroBatch
from schemas.config import ArlConfig

log = logging.getLogger("arl.trainer.megatron")
LAYOUT_FILE = "megatron_layout.json"
SCHEDULER_FILE = "scheduler.pt"


class MegatronBackend:
    """See `pipeline.trainer.backend.TrainBackend` for the contract of each method."""

    def __init__(self, config: ArlConfig, total_updates: int) -> None:
        self.config, self.total_updates = config, total_updates
        self.logit_scale = logit_scale(config.rollout.temperature)
        mc = config.trainer.megatron
        self.topo = parallel.init(mc.tp, mc.pp, config.trainer.device, config.trainer.seed)
        self.rank, self.world_size, self.device = self.topo.rank, self.topo.world_size, self.topo.device
        self.layout: Literal["packed", "padded"] = "packed"  # its attention reads per-sample boundaries
        cuda = self.device.type == "cuda"
        if mc.sequence_parallel and not cuda:
            raise ValueError(
                "trainer.megatron.sequence_parallel needs CUDA (gloo has no reduce-scatter); set it to false on CPU"
            )
        dtype = torch.bfloat16 if cuda and config.trainer.bf16 else torch.float32
        self.settings = RunSettings(mc.tp, mc.pp, mc.sequence_parallel and mc.tp > 1, dtype, cuda)
        self.save_dtype = getattr(torch, config.model.dtype)
        self.model: Any = None
        self.reference: Any = None
        self.ddp: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.num_params = 0

    # -- set-up ---------------------------------------------------------------------------------
    def load(self, weights: Path, state: Path | None) -> None:
        self.dims = ModelDims.from_hf(Path(weights))
        self.tconfig = transformer_config(self.dims, self.settings)
        self.num_params = self.dims.num_params()
        groups = parallel.groups()
        self.mp_group, self.dp_group, self.embd_group = groups["mp"], groups["dp"], groups["embedding"]
        self.vocab = VocabShard.of(
            self.dims.vocab_size, self.dims.padded_vocab(self.topo.tp), self.topo.tp_rank, self.topo.tp, groups["tp"]
        )
        self.shape = StageShape(
            self.dims.hidden_size, self.settings.dtype, self.topo.tp if self.settings.sequence_parallel else 1
        )
        self.reporter = self._mp_global_rank(self.topo.pp - 1, 0)
        self.model = self._load_model(Path(weights), trainable=True)
        self._make_optimizer()
        if state is not None:
            self._load_state(Path(state))
        if self.config.trainer.algorithm.kl_coef > 0:
            self.reference = self._load_model(Path(self.config.model.path), trainable=False)

    def _load_model(self, path: Path, trainable: bool) -> Any:
        model = build_model(
            self.dims, self.tconfig, pre_process=self.topo.is_first_stage, post_process=self.topo.is_last_stage
        )
        model.to(self.device)
        load_hf_into(model, path, self.dims, self.topo)
        model.train(trainable)
        model.requires_grad_(trainable)
        return model

    def _make_optimizer(self) -> None:
        opt = self.config.trainer.optimizer
        if self.settings.cuda:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            )
            self.ddp = DistributedDataParallel(self.tconfig, ddp_config, self.model)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=opt.lr,
                    weight_decay=opt.weight_decay,
                    adam_beta1=opt.betas[0],
                    adam_beta2=opt.betas[1],
                    adam_eps=opt.eps,
                    clip_grad=opt.grad_clip,
                    bf16=self.settings.dtype == torch.bfloat16,
                    params_dtype=self.settings.dtype,
                ),
                [self.ddp],
            )
            inner = _torch_optimizer(self.optimizer)
        else:
            inner = self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
            )
        self.scheduler = make_scheduler(inner, opt, self.total_updates)

    def _mp_global_rank(self, pp_rank: int, tp_rank: int) -> int:
        """Global rank of the member (pp_rank, tp_rank) of this rank's model-parallel group."""
        import torch.distributed as dist

        coords: list[Any] = [None] * dist.get_world_size(self.mp_group)
        dist.all_gather_object(coords, (self.topo.pp_rank, self.topo.tp_rank, self.topo.rank), group=self.mp_group)
        return next(g for p, t, g in coords if (p, t) == (pp_rank, tp_rank))

    # -- compute --------------------------------------------------------------------------------
    def _share(self, micros: list[MicroBatch]) -> tuple[list[MicroBatch], int, int]:
        """All micro-batches of the MP group in group order, plus the slice [start, end) that is ours."""
        import torch.distributed as dist

        size = dist.get_world_size(self.mp_group)
        if size == 1:
            return micros, 0, len(micros)
        lists: list[Any] = [None] * size
        dist.all_gather_object(lists, micros, group=self.mp_group)
        me = dist.get_rank(self.mp_group)
        start = sum(len(lists[i]) for i in range(me))
        return [m for chunk in lists for m in chunk], start, start + len(micros)

    def _run(self, model: Any, micros: list[MicroBatch], on_logits: Any, backward: bool) -> None:
        multiple = self.topo.tp if self.settings.sequence_parallel else 1
        inputs = [pack_inputs(m, self.device, multiple) for m in micros]
        forward_backward(model, inputs, self.topo, self.shape, on_logits, backward=backward)

    @torch.no_grad()
    def logprobs(self, micro: MicroBatch, *, reference: bool = False) -> torch.Tensor:
        import torch.distributed as dist

        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested but no reference model is loaded (kl_coef == 0)")
        micros, start, _ = self._share([micro])
        results: list[torch.Tensor | None] = [None] * len(micros)

        def on_logits(i: int, logits: torch.Tensor) -> None:
            targets = micros[i].targets.to(self.device)
            logp, _ = token_logprobs(logits * self.logit_scale, targets, self.vocab, with_entropy=False)
            results[i] = logp.float().cpu()

        self._run(model, micros, on_logits, backward=False)
        if len(micros) > 1 or self.topo.pp > 1:
            box = [results]
            dist.broadcast_object_list(box, src=self.reporter, group=self.mp_group)
            results = box[0]
        out = results[start]
        assert out is not None
        return out

    def train_minibatch(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> MinibatchStats:
        algo = self.config.trainer.algorithm
        micros, _, _ = self._share(micro_batches)
        self._zero_grad()
        acc = LossAccumulator()

        def on_logits(i: int, logits: torch.Tensor) -> torch.Tensor:
            micro = micros[i].to(self.device)
            logp, entropy = token_logprobs(logits * self.logit_scale, micro.targets, self.vocab, with_entropy=True)
            if algo.entropy_coef == 0 and entropy is not None:
                entropy = entropy.detach()
            out = loss_fn(logp, entropy, micro.tokens)
            acc.add(out)
            return out.loss

        self._run(self.model, micros, on_logits, backward=True)
        grad_norm = self._step()
        loss, sums_out, maxima_out = self._report(acc.loss, dict(acc.sums), dict(acc.maxima))
        tokens = sum(m.num_tokens for m in micros) if self.rank == self.reporter else 0
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        # Per-token values from the reporter only, like the sums (the other MP ranks saw the same rows or none).
        per_token = acc.per_token() if self.rank == self.reporter else {}
        return MinibatchStats(loss, grad_norm, lr, tokens, sums_out, maxima_out, per_token)

    def _zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _step(self) -> float:
        """Sync gradients, clip the global norm, one optimizer step; returns the pre-clip norm."""
        if self.ddp is not None:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm) if grad_norm is not None else float("nan")
        from megatron.core import parallel_state

        from pipeline.trainer.megatron.grads import clip_global_norm, sync_cpu_grads

        tp_group = parallel_state.get_tensor_model_parallel_group() if self.topo.tp > 1 else None
        sync_cpu_grads(self.model, self.dp_group, self.embd_group, self.topo, tp_group)
        grad_norm = clip_global_norm(
            list(self.model.parameters()), self.config.trainer.optimizer.grad_clip, self.mp_group
        )
        self.optimizer.step()
        return grad_norm

    def _report(self, loss: float, sums: dict[str, float], maxima: dict[str, float]) -> tuple[float, dict, dict]:
        """The reporter's statistics everywhere, with sums zeroed off the reporter (the loop sums over ranks)."""
        import torch.distributed as dist

        if dist.get_world_size(self.mp_group) > 1:
            box = [(loss, sums, maxima)]
            dist.broadcast_object_list(box, src=self.reporter, group=self.mp_group)
            loss, sums, maxima = box[0]
        if self.rank != self.reporter:
            loss, sums = 0.0, dict.fromkeys(sums, 0.0)
        return loss, sums, maxima

    # -- export ---------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_hf(self.model, self.dims, self.topo, self.save_dtype)

    def save_state(self, out_dir: Path) -> None:
        """Each rank writes its own optimizer shard into rank 0's staging dir (a shared file system, as the
        run dir is); rank 0 adds the scheduler and the layout, which resume must match."""
        import torch.distributed as dist

        box = [str(out_dir)]
        dist.broadcast_object_list(box, src=0)
        target = Path(box[0])
        save_torch(self.optimizer.state_dict(), target / f"optimizer_rank{self.rank:05d}.pt")
        if self.rank == 0:
            save_torch(self.scheduler.state_dict(), target / SCHEDULER_FILE)
            (target / LAYOUT_FILE).write_text(json.dumps(self._layout(), sort_keys=True) + "\n")
        dist.barrier()

    def _layout(self) -> dict[str, Any]:
        t = self.topo
        return {
            "backend": "megatron",
            "tp": t.tp,
            "pp": t.pp,
            "dp": t.dp,
            "device": self.device.type,
            "dtype": str(self.settings.dtype),
        }

    def _load_state(self, state: Path) -> None:
        layout_file = state / LAYOUT_FILE
        if not layout_file.exists():
            raise RuntimeError(
                f"{state} holds no megatron optimizer state (written by another backend?); resume "
                "with the backend that wrote it, or start a new run"
            )
        saved = json.loads(layout_file.read_text())
        if saved != self._layout():
            raise RuntimeError(
                f"{state} was written with megatron layout {saved}, this run has {self._layout()}; "
                "resume with the same trainer.megatron.tp/pp, world size and device"
            )
        shard = state / f"optimizer_rank{self.rank:05d}.pt"
        self.optimizer.load_state_dict(torch.load(shard, map_location="cpu", weights_only=False))
        self.scheduler.load_state_dict(torch.load(state / SCHEDULER_FILE, map_location="cpu", weights_only=False))

    def close(self) -> None:
        self.model = self.reference = self.ddp = self.optimizer = self.scheduler = None
        parallel.destroy()


def _torch_optimizer(megatron_optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside megatron's (mixed-precision) optimizer, possibly wrapped in a ChainedOptimizer:
    the lr schedule is applied to its param groups (megatron's own scheduler is not used)."""
    chained = getattr(megatron_optimizer, "chained_optimizers", None)
    parts = list(chained) if chained is not None else [megatron_optimizer]
    if len(parts) != 1:
        raise RuntimeError(f"expected one dense megatron optimizer, got {len(parts)} (MoE models are not supported)")
    inner = parts[0].optimizer
    assert isinstance(inner, torch.optim.Optimizer)
    return inner
