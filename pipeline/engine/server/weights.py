"""Loading the `hf` engine's model and swapping its weights in place.

Weights are copied into the existing parameters (`param.copy_`), never by building a second
model: on a GPU that would need twice the memory, and in place keeps tied parameters tied.
A new checkpoint is checked first (every name known, every shape equal, every parameter
covered) and only then applied, so a bad checkpoint is refused with the model untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightError(ValueError):
    """A checkpoint or a set of named tensors does not fit the served model (the caller's error: 400)."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use cpu or auto")
    return torch.device(device)


def load_model(model_path: str | Path, *, device: torch.device, dtype: str) -> Any:
    """The causal LM at `model_path`, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = Path(model_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[dtype])
    model = model.to(device).eval()
    if device.type == "cpu":  # off the checkpoint's file mapping: the first weight update's copy took ~10x longer
        for param in model.parameters():
            param.data = param.data.clone()
    return model


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids: the generation config's (one or a list) plus the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files of a Hugging Face directory."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise WeightError(f"model_path {str(path)!r} is not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {directory} (is the checkpoint complete?)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def to_model_names(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the served model's own parameter names. A checkpoint in the hub's layout (a Qwen3-MoE's
    experts one tensor each: `experts.0.gate_proj.weight`, ...) is converted by transformers' own conversion mapping
    of the model (what `from_pretrained` applies: experts fused into `gate_up_proj`/`down_proj`); names that are
    already parameters pass as they are."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if all(name in params for name in tensors):
        return tensors
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    pending: dict[str, Any] = {}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            out[target] = tensors[name]
            continue
        converter = pending.setdefault(target, deepcopy(by_pattern[pattern]))
        converter.add_tensor(target, name, pattern, tensors[name])
    for target, converter in pending.items():
        for key, value in converter.convert(target, model=model, config=model.config).items():
            out[key] = value[0] if isinstance(value, list) else value
    return out


def check_named_tensors(
    model: Any, named: dict[str, torch.Tensor] | list[tuple[str, list[int]]], *, require_all: bool
) -> None:
    """Refuse unknown names, wrong shapes and (when `require_all`) uncovered parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    items = [(n, list(t.shape)) for n, t in named.items()] if isinstance(named, dict) else named
    unknown = [n for n, _ in items if n not in params]
    if unknown:
        raise WeightError(
            f"{len(unknown)} names are not parameters of the served model, e.g. {unknown[:5]}; "
            f"expected names like {list(params)[:3]}"
        )
    bad = [(n, s, list(params[n].shape)) for n, s in items if list(s) != list(params[n].shape)]
    if bad:
        raise WeightError(f"shape mismatch (name, got, expected): {bad[:5]}")
    if require_all:
        covered = {params[n].data_ptr() for n, _ in items}  # tied parameters share storage
        missing = [n for n, p in params.items() if p.data_ptr() not in covered]
        if missing:
            raise WeightError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")


@torch.no_grad()
def apply_named_tensors(model: Any, named: dict[str, torch.Tensor]) -> int:
    """Copy tensors into the model's parameters (dtype/device converted); returns how many."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in named.items():
        target = params[name]
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(named)


@torch.no_grad()
def swap_named_tensors(model: Any, named: dict[str, torch.Tensor], spare: dict[str, torch.Tensor]) -> int:
    """Make each tensor the storage of its parameter when dtype, device and shape match (no copy: a 2 GB model
    swaps in microseconds instead of a 0.2 s copy), keeping the old storage in `spare[name]`; copy the others.
    A tied parameter is one object, so swapping it keeps it tied."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in named.items():
        target = params[name]
        if tensor.dtype == target.dtype and tensor.device == target.device and tensor.shape == target.shape:
            spare[name], target.data = target.data, tensor
        else:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(named)


def model_summary(model: Any, model_path: str) -> dict[str, Any]:
    config = model.config
    return {
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "vocab_size": int(config.vocab_size),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "config": json.loads(config.to_json_string()) if hasattr(config, "to_json_string") else None,
        "model_path": model_path,
    }
