"""`trainer:` — the algorithm, optimizer, checkpoints and weight publication."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.config.base import UNSUPPORTED, Block


class MismatchConfig(Block):
    """Training-inference mismatch correction: what the decoupled objective does with the behaviour importance
    weight w = pi_prox / pi_behav (docs/trainer.md, "Training-inference mismatch")."""

    level: Literal["token", "sequence"] = "token"
    """`token`: each token's own w_t; `sequence`: one weight per sample, the geometric mean of its tokens' ratios
    exp(mean_t log w_t), for all its tokens (the product would over- or underflow on long samples)."""
    mode: Literal["truncate", "mask"] = "mask"
    """`truncate`: the weight becomes min(w, high) (truncated importance sampling); `mask`: tokens (level token) or
    whole samples (level sequence) whose weight leaves [low, high] are dropped from the loss (masked importance
    sampling)."""
    low: float | None = Field(None, ge=0)
    """`mask` only: drop below this weight too; `None` = no lower bound."""
    high: float | None = Field(5.0, gt=0)
    """Truncation cap (`truncate`) or upper bound (`mask`); `None` = no bound (plain importance weight)."""

    @model_validator(mode="after")
    def _bounds(self) -> MismatchConfig:
        if self.low is not None and self.mode != "mask":
            raise PydanticCustomError(
                UNSUPPORTED, "trainer.algorithm.mismatch.low needs mode=mask (truncation caps from above only)", {}
            )
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise PydanticCustomError(
                UNSUPPORTED,
                "trainer.algorithm.mismatch: low ({low}) must be below high ({high})",
                {"low": self.low, "high": self.high},
            )
        return self


class AlgorithmConfig(Block):
    renamed_keys: ClassVar[dict[str, str]] = {
        "behav_imp_cap": "write trainer.algorithm.mismatch.high (null = uncapped)",
        "behav_imp_mode": "write trainer.algorithm.mismatch.mode: truncate (was cap) or mask",
    }

    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """`grpo` = (r - mean) / std per group; `drgrpo` = r - mean (no std); `rloo` = leave-one-out baseline."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range (lower side)."""
    clip_eps_high: float | None = None
    """Upper clip range; `None` = `clip_eps` (set higher for clip-higher)."""
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    """Correction of the behaviour importance weight pi_prox/pi_behav in the decoupled objective (the default, token
    level masked above 5, is AReaL's)."""
    decoupled: bool = True
    """Recompute proximal log-probs with the current weights (decoupled PPO) instead of trusting behaviour ones."""
    loss_agg: Literal["token", "sequence"] = "token"
    """`token` = mean over all tokens of the minibatch; `sequence` = mean over sequences of per-sequence means."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a frozen reference model (0 = no reference is loaded)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    task_normalize: bool = False
    """With `rollout.tasks`: divide each task's advantages by their standard deviation over the step, so that a
    task whose rewards spread wider does not outweigh the others (for `drgrpo` and `rloo`; `grpo` already scales
    each group by its own std)."""


class OptimizerConfig(Block):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup length in optimizer steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup, down to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of `lr`."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""


class MegatronConfig(Block):
    tp: int = Field(1, ge=1)
    """Tensor parallel size."""
    pp: int = Field(1, ge=1)
    """Pipeline parallel size."""
    sequence_parallel: bool = False
    """Sequence parallelism (GPU, needs tp > 1)."""


class LoraConfig(Block):
    """Train low-rank adapters (PEFT's LoRA) on a frozen base instead of every weight (torch backend)."""

    rank: int = Field(16, ge=1)
    """LoRA rank r of each adapted projection."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training forwards (log-prob passes run without it)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (PEFT's `target_modules`, e.g. [q_proj, v_proj]); `all-linear` = every linear layer
    of the decoder (not the output layer). Only linear layers can be adapted (merging is plain W + s * B @ A)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Normalization layers trained in full beside the adapters and saved with them (PEFT's `modules_to_save`;
    `[norm]` = every module whose name ends in `norm`). Only norms: a merge then replaces their weights. Needs
    `publish: merged` (the engines' LoRA routes load A and B matrices only)."""
    lr_ratio: float = Field(1.0, gt=0)
    """LoRA+: the B matrices (the adapter's output side, zero at the start) and the trained norms' weights learn at
    `lr_ratio` times `trainer.optimizer.lr`, the A matrices at the lr itself (PEFT's LoRA+ grouping; Hayou et al.
    2024 suggest 16; 1 = plain LoRA)."""
    publish: Literal["merged", "adapter"] = "merged"
    """How servers get a new version: `merged` = the trainer merges the adapter into the base and publishes full
    weights by `trainer.weight_sync` (any engine); `adapter` = servers load each version's adapter from its
    checkpoint directory by their own LoRA routes, under a name per version (needs `trainer.weight_sync: disk`)."""


class TrainerConfig(Block):
    backend: Literal["torch", "megatron"] = "torch"
    """`torch` = Hugging Face model (FSDP2 across GPUs); `megatron` = megatron-core GPTModel."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator and policy loss."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallelism of the `megatron` backend."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on a frozen base (torch backend; needs `arl[lora]`); `None` = train every weight.
    See docs/trainer.md, "LoRA"."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device; `auto` = CUDA when available."""
    bf16: bool = True
    """bf16 autocast on GPU (ignored on CPU, which trains in fp32)."""
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per step (the step's samples are split into this many minibatches)."""
    micro_batch_tokens: int = Field(16384, ge=64)
    """Token budget of one micro-batch (packed: one row of up to this many tokens; padded: rows × longest)."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """Micro-batch layout: `packed` = samples concatenated in one row (no padding; cheap only with a varlen
    attention kernel, flash-attention-2), `padded` = right-padded rows sorted by length (sdpa's fused causal
    path; the fast choice on CPU and without flash-attn), `auto` = packed with flash-attention-2, else padded.
    The megatron backend always packs."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    weight_sync: Literal["disk", "nccl"] = "disk"
    """`disk` = servers reload the checkpoint; `nccl` = broadcast to servers (gloo on CPU)."""
    checkpoint_every: int = Field(1, ge=1)
    """Write an HF-layout checkpoint every this many steps (disk sync writes one every step regardless)."""
    keep_checkpoints: int = Field(3, ge=1)
    """Checkpoints kept (older ones are deleted after a newer one is complete)."""
    wait_timeout_s: float = Field(3600.0, gt=0)
    """Deadline for a step's trajectories to appear."""
    publish_timeout_s: float = Field(600.0, gt=0)
    """Deadline of each call to an inference server during a publication (pause, a disk reload, a bucket's
    answer, the verification), and of the wait for servers taken out to come back when fewer than
    `inference.min_servers` verified a version."""
    broadcast_timeout_s: float = Field(300.0, gt=0)
    """Deadline of the weight-broadcast group's setup and of each bucket's broadcast (`nccl` sync): a server
    that dies or stalls mid-broadcast ends the wait with an error naming it instead of a hang."""
    verify: bool = True
    """Check every server after every weight swap (a probe's input log-probabilities and a sample of
    weights against the trainer's own) before the version is announced; see docs/reliability.md."""
    verify_tolerance: float | None = Field(None, gt=0)
    """Largest allowed |server - trainer| log-probability at any probe position; `None` = by `model.dtype`
    (float32 0.002, float16 0.01, bfloat16 0.05)."""
    deterministic: bool = False
    """Deterministic algorithms and fixed seeds (bitwise-reproducible resume on CPU)."""
    seed: int = 0
    """Seed of the trainer's RNGs."""

    @model_validator(mode="after")
    def _megatron_packs(self) -> TrainerConfig:
        if self.backend == "megatron" and self.packing == "padded":
            raise PydanticCustomError(
                UNSUPPORTED,
                "trainer.packing=padded needs trainer.backend=torch: the megatron backend packs its rows (its "
                "attention reads the per-sample boundaries); use packing=auto or packed",
                {},
            )
        return self

    @property
    def publishes_adapters(self) -> bool:
        """LoRA with `publish: adapter`: the servers load each version's adapter (no merged weights are written)."""
        return self.lora is not None and self.lora.publish == "adapter"

    @model_validator(mode="after")
    def _adapter_publication_reads_disk(self) -> TrainerConfig:
        if self.publishes_adapters and self.weight_sync != "disk":
            raise PydanticCustomError(
                UNSUPPORTED,
                "trainer.lora.publish=adapter: servers load each adapter from its checkpoint directory, "
                "so it needs trainer.weight_sync=disk (or trainer.lora.publish=merged to broadcast merged weights)",
                {},
            )
        return self

    @model_validator(mode="after")
    def _adapter_publication_is_plain_lora(self) -> TrainerConfig:
        if self.publishes_adapters and self.lora is not None and self.lora.modules_to_save:
            raise PydanticCustomError(
                UNSUPPORTED,
                "trainer.lora.modules_to_save needs trainer.lora.publish=merged: SGLang's, vLLM's and "
                "the hf engine's LoRA routes load A and B matrices only, not trained norms",
                {},
            )
        return self

    @model_validator(mode="after")
    def _lora_needs_torch(self) -> TrainerConfig:
        if self.lora is not None and self.backend == "megatron":
            raise PydanticCustomError(
                UNSUPPORTED,
                "trainer.lora needs trainer.backend=torch (the megatron backend trains full weights only)",
                {},
            )
        return self
