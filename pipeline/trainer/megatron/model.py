"""A megatron-core `GPTModel` equal to a Hugging Face Qwen2 / Qwen2.5 / Llama-3 causal LM.

`ModelDims.from_hf` reads the HF `config.json` (what the checkpoint is); `transformer_config`
adds how we run it (TP/PP sizes, dtype, device); `build_model` builds one pipeline stage of the
GPTModel with `layer_spec()`: megatron's local (TransformerEngine-free) spec with our SDPA core
attention in place of the unfused `DotProductAttention` (see sdpa_attention.py).

Architecture mapping (what makes the logits equal HF's within 1e-4 in fp32):
- RMSNorm with the model's eps (torch norms), SwiGLU MLP as a gated fc1 (`gated_linear_unit`,
  silu), no linear biases except the qkv bias of Qwen2 (`add_qkv_bias`); Llama's
  `attention_bias`/`mlp_bias` variants are refused rather than silently dropped.
- GQA: `num_query_groups` = HF `num_key_value_heads`; `kv_channels` = head_dim (Llama configs may set
  it explicitly), softmax scale 1/sqrt(head_dim) as in HF.
- Rope on the full head dim, non-interleaved (HF's rotate_half), base = the model's rope theta;
  Llama-3.1 `llama3` rope scaling maps to megatron's `rope_scaling` (which hard-codes Meta's
  low/high frequency factors 1 and 4 and original context 8192: other values are refused).
- Tied or untied embeddings (`share_embeddings_and_output_weights`).
- Vocab padding: megatron splits the vocabulary evenly over TP ranks, so it is padded up to a
  multiple of tp. The padded rows exist in the embedding and output layer (zero, never looked up);
  the backend slices their logits away before the softmax, so they never change log-probs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class ModelDims:
    """The architecture of a Qwen2/Qwen3/Llama-family checkpoint, as megatron needs it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    """Llama-3.1 style scaling factor, or None for plain rope."""
    qkv_bias: bool
    tied_embeddings: bool
    max_position_embeddings: int
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's queries and keys before rope (megatron's `qk_layernorm`)."""

    @classmethod
    def from_hf(cls, model_dir: Path) -> ModelDims:
        """Read `config.json`; refuse what the megatron model cannot reproduce exactly."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_hf_dict(cfg, where=str(model_dir))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], where: str = "config") -> ModelDims:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{where}: model_type {model_type!r} is not supported by the megatron backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use trainer.backend=torch"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
        if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
            raise ValueError(
                f"{where}: {model_type} with attention_bias/mlp_bias is not supported by the megatron backend"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, factor = _rope(cfg, where)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling_factor=factor,
            qkv_bias=model_type == "qwen2",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            qk_norm=model_type == "qwen3",
        )

    def padded_vocab(self, tp: int) -> int:
        """Vocab rounded up to a multiple of tp (megatron splits the vocab evenly across TP ranks)."""
        return math.ceil(self.vocab_size / tp) * tp

    def num_params(self) -> int:
        """Parameters of the HF model (the tied output layer counted once): the MFU numerator's N."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * h * self.ffn_hidden_size + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embed + h


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None): transformers 5 `rope_parameters`, or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: float(params.get(k, v)) for k, v in expected.items()}
        if got != {k: float(v) for k, v in expected.items()}:
            raise ValueError(f"{where}: llama3 rope scaling {got} differs from megatron-core's fixed {expected}")
        return theta, float(params["factor"])
    raise ValueError(f"{where}: rope_type {kind!r} is not supported by the megatron backend (default, llama3)")


@dataclass(frozen=True)
class RunSettings:
    """How the model runs (not what it is)."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.float32
    """Parameter dtype: fp32 on CPU; bf16 on GPU (fp32 master weights live in megatron's optimizer)."""
    cuda: bool = False


def transformer_config(dims: ModelDims, run: RunSettings) -> Any:
    """The megatron `TransformerConfig` (no fusions that need apex/TE; no dropout: RL needs exact log-probs)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dims.num_layers % run.pp:
        raise ValueError(f"num_hidden_layers={dims.num_layers} is not divisible by trainer.megatron.pp={run.pp}")
    if dims.num_kv_heads % run.tp or dims.num_heads % run.tp:
        raise ValueError(
            f"trainer.megatron.tp={run.tp} must divide num_attention_heads={dims.num_heads} and "
            f"num_key_value_heads={dims.num_kv_heads}"
        )
    if dims.ffn_hidden_size % run.tp:
        raise ValueError(f"trainer.megatron.tp={run.tp} must divide intermediate_size={dims.ffn_hidden_size}")
    bf16 = run.dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=run.tp,
        pipeline_model_parallel_size=run.pp,
        sequence_parallel=run.sequence_parallel,
        params_dtype=run.dtype,
        bf16=bf16,
        pipeline_dtype=run.dtype if run.pp > 1 else None,
        calculate_per_token_loss=True,  # our losses are already globally weighted: DDP must SUM, not average
        # perform_initialization must stay on even though every weight is overwritten by the HF checkpoint:
        # megatron marks tensor-parallel weights (`tensor_model_parallel`, used by grad-norm and optimizer
        # code to count TP-split vs replicated parameters) only inside its init functions.
        use_cpu_initialization=not run.cuda,
        perform_initialization=True,
    )


def layer_spec(qk_norm: bool = False) -> Any:
    """megatron's local GPT layer spec (RMSNorm; with `qk_norm` its q/k layernorms) with `SDPAAttention` as the core
    attention."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from pipeline.trainer.megatron.sdpa_attention import SDPAAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=SDPAAttention)
    return spec


def build_model(dims: ModelDims, config: Any, *, pre_process: bool, post_process: bool) -> Any:
    """One pipeline stage of the GPTModel (its layers are chosen by megatron's pipeline rank)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims.qk_norm),
        vocab_size=dims.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=dims.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=dims.rope_theta,  # type: ignore[arg-type]
        rope_scaling=dims.rope_scaling_factor is not None,
        rope_scaling_factor=dims.rope_scaling_factor or 8.0,
    )
    return model
