"""The `torch` trainer backend: a Hugging Face causal LM, AdamW, one process or FSDP2 across many.

Precision: master weights in fp32 on GPU with bf16 autocast (`trainer.bf16`); on CPU the weights stay
in `model.dtype` (fp32 by default) with no autocast. Log-probs and the loss are always fp32.

Attention: packed rows rely on position ids that restart per sample (see packing.py). `sdpa` is the
default (correct on CPU and GPU: transformers builds a block-diagonal causal mask from the position
ids); on GPU with the `flash_attn` package installed, `flash_attention_2` is used instead, whose
varlen kernel reads the same position ids and skips the masked blocks entirely.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.trainer import fsdp, lora
from pipeline.trainer.backend import LossAccumulator, LossFn, MinibatchStats
from pipeline.trainer.checkpoint import save_torch
from pipeline.trainer.losses import entropy_from_logits, gather_logprobs, logit_scale
from pipeline.trainer.lr_schedule import make_scheduler
from pipeline.trainer.packing import MicroBatch
from schemas.config import ArlConfig

log = logging.getLogger("arl.trainer")
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"


def micro_batch_layout(packing: str, attn: str) -> Literal["packed", "padded"]:
    """`trainer.packing` resolved: `auto` packs only for a varlen kernel (flash-attention), which skips the
    blocks between packed samples; sdpa would compute them all (see pipeline/trainer/packing.py)."""
    if packing == "auto":
        return "packed" if attn.startswith("flash") else "padded"
    return "padded" if packing == "padded" else "packed"


def attn_implementation(device: torch.device) -> str:
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            import flash_attn  # noqa: F401

            return "flash_attention_2"
    return "sdpa"


class TorchBackend:
    """See `pipeline.trainer.backend.TrainBackend` for the contract of each method."""

    def __init__(self, config: ArlConfig, total_updates: int) -> None:
        self.config = config
        self.logit_scale = logit_scale(config.rollout.temperature)
        self.total_updates = total_updates
        self.dist = fsdp.init_distributed(config.trainer.device)
        self.rank, self.world_size, self.device = self.dist.rank, self.dist.world_size, self.dist.device
        self.autocast = self.device.type == "cuda" and config.trainer.bf16
        self.layout = micro_batch_layout(config.trainer.packing, attn_implementation(self.device))
        self.save_dtype = getattr(torch, config.model.dtype)
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.num_params = 0

    # -- set-up ---------------------------------------------------------------------------------
    def load(self, weights: Path, state: Path | None) -> None:
        self.model = self._load_model(weights, trainable=True)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        opt = self.config.trainer.optimizer
        self.optimizer = torch.optim.AdamW(
            lora.param_groups(self.model, opt.lr, self.config.trainer.lora),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            fused=self.device.type == "cuda",
            foreach=self.device.type != "cuda",  # CPU: batched, not per tensor
        )
        self.scheduler = make_scheduler(self.optimizer, opt, self.total_updates)
        if state is not None:
            self._load_state(state)
        if self.config.trainer.algorithm.kl_coef > 0 and self.config.trainer.lora is None:
            # The frozen reference is the run's initial model (version 0), whatever version we resume from
            # (with LoRA: the policy itself with its adapters disabled, see `_lora_logprobs`).
            self.reference = self._load_model(Path(self.config.model.path), trainable=False)

    def _load_model(self, path: Path, trainable: bool) -> Any:
        """The HF model at `path`; with `trainer.lora` the base wrapped with the adapter `path` holds (fresh
        adapters for version 0, whose `path` is the base itself)."""
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if self.device.type == "cuda" else self.save_dtype
        adapter = path if self.config.trainer.lora is not None and lora.is_adapter_dir(path) else None
        model = AutoModelForCausalLM.from_pretrained(
            self.config.model.path if adapter else str(path),
            dtype=dtype,
            attn_implementation=attn_implementation(self.device),
        )
        model.to(self.device)  # type: ignore[arg-type]
        model.config.use_cache = False
        if trainable:
            model.train()
            if self.config.trainer.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.config.trainer.lora is not None:  # adapters before sharding: FSDP2 shards them with their layer
                model = lora.wrap(model, self.config.trainer.lora, adapter)
        else:
            model.eval()
            model.requires_grad_(False)
        if self.world_size > 1:
            fsdp.shard_model(model)
        return model

    def _load_state(self, state: Path) -> None:
        optim_state = (
            torch.load(state / OPTIMIZER_FILE, map_location="cpu", weights_only=False) if self.rank == 0 else {}
        )
        fsdp.load_optimizer_state(self.model, self.optimizer, optim_state, self.world_size)
        self.scheduler.load_state_dict(torch.load(state / SCHEDULER_FILE, map_location="cpu", weights_only=False))

    # -- compute --------------------------------------------------------------------------------
    def _logits(self, model: Any, micro: MicroBatch) -> torch.Tensor:
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            out = model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False)
        logits = out.logits.reshape(-1, out.logits.shape[-1])  # [T, V]: one packed row, or padded rows flattened
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    @torch.no_grad()
    def logprobs(self, micro: MicroBatch, *, reference: bool = False) -> torch.Tensor:
        micro = micro.to(self.device)
        if self.config.trainer.lora is not None:
            return self._lora_logprobs(micro, reference)
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested but no reference model is loaded (kl_coef == 0)")
        return gather_logprobs(self._logits(model, micro), micro.targets).float().cpu()

    def _lora_logprobs(self, micro: MicroBatch, reference: bool) -> torch.Tensor:
        """The policy without adapter dropout; the reference is the base: the same model, adapters disabled."""
        self.model.eval()
        try:
            with self.model.disable_adapter() if reference else contextlib.nullcontext():
                return gather_logprobs(self._logits(self.model, micro), micro.targets).float().cpu()
        finally:
            self.model.train()

    def train_minibatch(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> MinibatchStats:
        algo = self.config.trainer.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        acc = LossAccumulator()
        tokens = 0
        for micro in micro_batches:
            micro = micro.to(self.device)
            logits = self._logits(self.model, micro)
            logp = gather_logprobs(logits, micro.targets)
            if algo.entropy_coef != 0:
                entropy = entropy_from_logits(logits)
            else:
                with torch.no_grad():
                    entropy = entropy_from_logits(logits)
            out = loss_fn(logp, entropy, micro.tokens)
            # FSDP averages gradients over ranks; the weights are already global, so undo the average.
            (out.loss * self.world_size).backward()
            acc.add(out)
            tokens += micro.num_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(lora.trainable(self.model), self.config.trainer.optimizer.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return MinibatchStats(acc.loss, float(grad_norm), lr, tokens, dict(acc.sums), dict(acc.maxima), acc.per_token())

    # -- export ---------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = fsdp.full_state_dict(self.model, self.world_size)
        if self.config.trainer.lora is not None and state:  # rank 0 merges the gathered adapter into the base
            state = lora.merged_weights(state, lora.scaling(self.model))
        return {k: v.to(self.save_dtype) for k, v in state.items()}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """With `trainer.lora`: the adapter under PEFT's saved names, in the training dtype (exact resume), on
        rank 0 (empty dict on other ranks). Collective."""
        adapter = lora.adapter_weights(self.model)
        return adapter if self.rank == 0 else {}

    def adapter_config(self) -> dict[str, Any]:
        """With `trainer.lora`: PEFT's `adapter_config.json` of this model, pointing at the base."""
        return lora.adapter_config(self.model, Path(self.config.model.path))

    def save_state(self, out_dir: Path) -> None:
        optim_state = fsdp.optimizer_state(self.model, self.optimizer, self.world_size)
        if self.rank == 0:
            save_torch(optim_state, out_dir / OPTIMIZER_FILE)
            save_torch(self.scheduler.state_dict(), out_dir / SCHEDULER_FILE)

    def close(self) -> None:
        self.model = self.reference = self.optimizer = self.scheduler = None
        fsdp.destroy()
