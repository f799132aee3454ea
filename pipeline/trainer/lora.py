"""LoRA for the torch backend (`trainer.lora`): PEFT adapters on a frozen base, their checkpoints, merging.

The policy is a `peft.PeftModel` around the Hugging Face base; only the adapter's parameters require grad, so
the optimizer (and its saved state) covers them alone. The KL reference is the same model with its adapters
disabled (`reference_logits`): no second copy of the base.

A LoRA checkpoint (`checkpoints/step_k/`) is PEFT's own format at the top level (`adapter_config.json`, whose
`base_model_name_or_path` points at the base, and `adapter_model.safetensors`), loadable by
`peft.PeftModel.from_pretrained(base, path)` without arl, plus the tokenizer; with `publish: merged` it also
holds `merged/`, the full model the engines load (`RunPaths.weights_dir`).

Merging is plain arithmetic on the gathered state dict, `W + (alpha / r) * B @ A` per adapted linear layer
(no module is modified, so it works the same on one process and under FSDP2, where rank 0 holds the gathered
state). `wrap` refuses adapters on anything but linear layers, which is what keeps that formula exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.server.weights import read_checkpoint
from pipeline.errors import ArlError, ConfigError
from pipeline.run.handoff import publish_dir, staging_dir
from pipeline.run.paths import ADAPTER_CONFIG, COMPLETE, MERGED, RunPaths, is_adapter_dir
from pipeline.trainer.checkpoint import copy_tokenizer, publish_checkpoint, write_hf_model
from schemas.config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"
"""PEFT's name for the one adapter; its state-dict keys carry it, its saved files do not."""
_PREFIX = "base_model.model."
"""What `PeftModel` puts in front of the base model's own parameter names."""
_TRAINED_COPY, _ORIGINAL = f".modules_to_save.{ADAPTER_NAME}.", ".original_module."
"""Where `PeftModel` keeps a `modules_to_save` module's trained copy and the frozen original, in parameter names."""


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"trainer.lora needs the peft package ({exc}): pip install 'arl[lora]'") from exc
    return peft


def wrap(model: Any, cfg: LoraConfig, adapter_dir: Path | None) -> Any:
    """`model` with fresh adapters (`adapter_dir` None: version 0) or the saved ones, trainable either way."""
    peft = _peft()
    if adapter_dir is None:
        targets: Any = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
        config = peft.LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=targets,
            modules_to_save=list(cfg.modules_to_save) or None,
            bias="none",
            task_type="CAUSAL_LM",
        )
        wrapped = peft.get_peft_model(model, config)
    else:
        wrapped = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    _check_mergeable(wrapped, peft)
    return wrapped


def _check_mergeable(model: Any, peft: Any) -> None:
    """Merging is exact only for plain linear adapters (no embeddings, convs, DoRA, rsLoRA, transposed weights)
    and for trained copies of norms (whose weights simply replace the base's)."""
    lora_layer, lora_linear = peft.tuners.lora.LoraLayer, peft.tuners.lora.Linear
    config = model.peft_config[ADAPTER_NAME]
    for name, module in model.named_modules():
        if isinstance(module, peft.utils.other.ModulesToSaveWrapper):
            if not type(module.original_module).__name__.endswith("Norm"):
                raise ConfigError(
                    f"trainer.lora.modules_to_save trains {name.removeprefix(_PREFIX)} "
                    f"({type(module.original_module).__name__}) in full: "
                    "only normalization layers can be (e.g. [norm])"
                )
            continue
        if not isinstance(module, lora_layer):
            continue
        if type(module) is not lora_linear or module.fan_in_fan_out or name.endswith("lm_head"):
            raise ConfigError(
                f"trainer.lora.target_modules adapts {name} ({type(module).__name__}): only the decoder's linear "
                "layers can be adapted; name them (e.g. [q_proj, v_proj]) or use all-linear"
            )
    if config.use_dora or config.use_rslora:
        raise ConfigError("a LoRA adapter with DoRA or rsLoRA cannot be merged by trainer.lora; train a plain one")


def scaling(model: Any) -> float:
    config = model.peft_config[ADAPTER_NAME]
    return float(config.lora_alpha) / float(config.r)


def trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def param_groups(model: Any, lr: float, cfg: LoraConfig | None) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: every trainable parameter at `lr`, except LoRA+'s B matrices at
    `lr * cfg.lr_ratio`, and the trained norms with them (a group per rate, in a fixed order, so saved optimizer
    state lines up on resume)."""
    if cfg is None or cfg.lr_ratio == 1.0:
        return [{"params": trainable(model), "lr": lr}]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    fast = [".lora_B." in name or p.dim() == 1 for name, p in named]  # PEFT's LoRA+: B and the 1-D norm weights
    a_side = [p for (_, p), f in zip(named, fast, strict=True) if not f]
    b_side = [p for (_, p), f in zip(named, fast, strict=True) if f]
    return [{"params": a_side, "lr": lr}, {"params": b_side, "lr": lr * cfg.lr_ratio}]


def merged_weights(full: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base's own parameter names and merged weights, from a `PeftModel`'s full state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        name = key.removeprefix(_PREFIX)
        if ".lora_A." in name or ".lora_B." in name or _ORIGINAL in name:
            continue
        if _TRAINED_COPY in name:  # a norm of `modules_to_save`: its trained copy replaces the base's
            out[name.replace(_TRAINED_COPY, ".")] = value
            continue
        if ".base_layer." not in name:
            out[name] = value
            continue
        module, leaf = name.split(".base_layer.")
        if leaf == "weight":
            a = full[f"{_PREFIX}{module}.lora_A.{ADAPTER_NAME}.weight"]
            b = full[f"{_PREFIX}{module}.lora_B.{ADAPTER_NAME}.weight"]
            value = _merge(value, a, b, scale)
        out[f"{module}.{leaf}"] = value
    return out


def merged_from_files(adapter_dir: Path, base_dir: Path) -> dict[str, torch.Tensor]:
    """Base + adapter as full Hugging Face weights, from the saved files alone (the publication's verifier when
    the trainer has no state dict in memory: a restarted trainer republishing its adapter checkpoint)."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    scale = float(config["lora_alpha"]) / float(config["r"])
    weights = read_checkpoint(base_dir)
    adapter = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    for key, a in adapter.items():
        if ".lora_" not in key:  # a trained norm (`modules_to_save`), saved under the base's own name
            weights[_base_name(key, weights, adapter_dir, base_dir)] = a
            continue
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
        base = weights.get(f"{module}.weight")
        if base is None:
            raise ArlError(f"{adapter_dir}: adapts {module}, which {base_dir} does not have")
        weights[f"{module}.weight"] = _merge(base, a, adapter[key.replace(".lora_A.", ".lora_B.")], scale)
    return weights


def _base_name(key: str, weights: dict[str, torch.Tensor], adapter_dir: Path, base_dir: Path) -> str:
    name = key.removeprefix(_PREFIX)
    if name not in weights:
        raise ArlError(f"{adapter_dir}: holds {name}, which {base_dir} does not have")
    return name


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`W + scale * B @ A` in fp32, back in W's dtype (what PEFT's merge computes for a plain linear adapter)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def adapter_weights(model: Any) -> dict[str, torch.Tensor]:
    """The adapter under the names PEFT saves (`...q_proj.lora_A.weight`), on CPU. Collective under FSDP2
    (each sharded parameter is gathered in the same order on every rank)."""
    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        name = name.replace(_TRAINED_COPY, ".")  # PEFT saves a trained norm under the base's own name
        out[name.replace(f".{ADAPTER_NAME}.", ".")] = tensor.detach().to("cpu", copy=True)
    return out


def adapter_config(model: Any, base: Path) -> dict[str, Any]:
    """PEFT's `adapter_config.json`, pointing at the base by its absolute path."""
    config = model.peft_config[ADAPTER_NAME].to_dict()
    config["base_model_name_or_path"] = str(base.resolve())
    config["inference_mode"] = True
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


@dataclass(frozen=True)
class AdapterCheckpoint:
    """What one LoRA checkpoint holds besides the tokenizer (`save_checkpoint`)."""

    weights: dict[str, torch.Tensor]
    """The adapter's parameters, under the names PEFT saves them by (`adapter_weights`)."""
    config: dict[str, Any]
    """PEFT's `adapter_config.json` (`adapter_config`)."""
    merged: dict[str, torch.Tensor] | None = None
    """The merged full model's state dict, written under `merged/`; None: the adapter alone (`publish: adapter`)."""


def save_checkpoint(
    paths: RunPaths,
    version: int,
    checkpoint: AdapterCheckpoint,
    model_dir: Path,
    tokenizer_dir: Path | None,
    dtype: str,
) -> Path:
    """Publish LoRA version `version` atomically: the adapter in PEFT's format, the tokenizer, and (when given)
    the merged full model under `merged/`; then point `LATEST` at it (as `checkpoint.save_checkpoint`)."""
    from safetensors.torch import save_file

    def fill(staged: Path) -> None:
        copy_tokenizer(tokenizer_dir or model_dir, staged)
        (staged / ADAPTER_CONFIG).write_text(json.dumps(checkpoint.config, indent=2, sort_keys=True) + "\n")
        weights = {k: v.contiguous() for k, v in checkpoint.weights.items()}
        save_file(weights, str(staged / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if checkpoint.merged is not None:
            (staged / MERGED).mkdir()
            write_hf_model(staged / MERGED, checkpoint.merged, model_dir, tokenizer_dir, dtype)

    return publish_checkpoint(paths, version, fill)


def base_of(adapter_dir: Path) -> Path:
    """The base model an adapter checkpoint points at (`base_model_name_or_path`)."""
    return Path(json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def export_merged(adapter_dir: Path, out: Path, base: Path | None = None) -> Path:
    """Write `base + adapter` merged by PEFT itself (`merge_and_unload`) as a Hugging Face model in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    peft = _peft()
    base = base or base_of(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    with staging_dir(out) as staged:
        merged.save_pretrained(str(staged))
        AutoTokenizer.from_pretrained(
            str(adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base)
        ).save_pretrained(str(staged))
        publish_dir(staged, out, COMPLETE, {"adapter": str(adapter_dir.resolve()), "base": str(base.resolve())})
    return out


def export_run_checkpoint(run_dir: Path, version: int, out: Path) -> Path:
    """`arl export-merged`: checkpoint `version` of a LoRA run, merged, into `out`; one-line errors for the rest."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise ArlError(f"{run_dir} is not a run directory (no {paths.config.name})")
    adapter = paths.checkpoint_dir(version)
    complete = paths.complete_checkpoints()
    if version not in complete:
        raise ArlError(
            f"no complete checkpoint of version {version} in {paths.checkpoints} "
            f"(complete: {', '.join(map(str, complete)) or 'none'})"
        )
    if not is_adapter_dir(adapter):
        raise ArlError(f"{adapter} holds full weights (a run without trainer.lora): it is already a Hugging Face model")
    if out.exists():
        raise FileExistsError(f"{out} exists: choose a new directory")
    return export_merged(adapter, out)
