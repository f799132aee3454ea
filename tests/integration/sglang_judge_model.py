"""The model inside `sglang_judge.py`'s stand-in scheduler: the real checkpoint, run with transformers on CPU.

Runs inside the SGLang venv, imported by the judge's scheduler process only. SGLang runs its own model classes
on a GPU; the judge runs the same checkpoint with transformers (dtype: SGLang's `ModelConfig.dtype`, i.e.
`--dtype`, or the checkpoint's own for `auto`) and gives SGLang's code what its model runner would:

- `prompt_logprobs`: the log-probabilities of a prompt, for SGLang's scheduler to turn into
  `input_token_logprobs` (log-softmax in float32 over the model's logits, as SGLang's logits processor);
- `load_weights`: the (name, tensor) pairs SGLang's `WeightUpdater` receives (broadcast) or reads (disk load),
  copied into the model's tensors of the same Hugging Face name; names the model has no tensor for are
  recorded and skipped; a known name with another shape fails the load, as SGLang's weight loaders do;
- `SGLangView`: what SGLang's `WeightExporter` asks for in `/get_weights_by_name`, an object of the class
  SGLang's model registry picks for the checkpoint's architecture. It has that class's own
  `get_weights_by_name` when the class defines one (Llama, Granite, OPT, ...) and none otherwise (Qwen2,
  Qwen3: SGLang's exporter then answers None, the route 400). Its parameters are the Hugging Face tensors laid
  out as SGLang's model holds them (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# How SGLang's Llama-family classes fuse Hugging Face tensors (their `stacked_params_mapping`, set in __init__).
STACKED_PARAMS_MAPPING = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                          (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]  # fmt: skip


def has_checkpoint(model_path: str) -> bool:
    path = Path(model_path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


class StandInModel(torch.nn.Module):
    """The checkpoint's Hugging Face model (or none: a model path without weights gives made-up logprobs)."""

    def __init__(self, model_path: str, dtype: torch.dtype, record: Callable[[Any], None]) -> None:
        super().__init__()
        self.record = record
        self.hf: Any = None
        if has_checkpoint(model_path):
            from transformers import AutoModelForCausalLM

            # SGLang's model parameters never require grad (its `get_weights_by_name` calls `.numpy()` on them)
            self.hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval().requires_grad_(False)
        self.corruption: tuple[str, str, float] | None = None  # (version, parameter, delta), see `corrupt`
        self.adapters: dict[str, Any] = {}
        """lora_id -> the model with that LoRA adapter merged in (SGLang applies it in its kernels)."""

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: list[int], start: int, count: int, lora_id: str | None = None) -> torch.Tensor:
        """[count, vocab] float32: row k is log p(. | input_ids[: start + k + 1]), from the model with LoRA adapter
        `lora_id` (None: the base); made up (uniform) without a model."""
        if self.hf is None:
            vocab = 1 + max(input_ids)
            return torch.full((count, vocab), -float(torch.log(torch.tensor(float(vocab)))))
        model = self.hf if lora_id is None else self.adapters[lora_id]
        logits = model(torch.tensor([input_ids])).logits[0, start : start + count]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def load_weights(self, weights: Any) -> None:
        """Record what SGLang handed over (names, dtypes, shapes, float64 sums), then copy it into the model."""
        weights = list(weights)
        own = dict(self.hf.state_dict()) if self.hf is not None else {}
        unmatched = [name for name, _ in weights if name not in own]
        self.record(_Loaded(names=[name for name, _ in weights],
                            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in weights],
                            shapes=[list(t.shape) for _, t in weights],
                            sums=[float(t.double().sum()) for _, t in weights], unmatched=unmatched))  # fmt: skip
        for name, tensor in weights:
            if name in own:
                if own[name].shape != tensor.shape:
                    raise ValueError(f"{name}: the model holds {list(own[name].shape)}, got {list(tensor.shape)}")
                own[name].copy_(tensor)

    @torch.no_grad()
    def add_adapter(self, lora_id: str, path: str, config: dict[str, Any]) -> None:
        """A copy of the model with the PEFT adapter at `path` merged in: W + lora_alpha / r * B @ A per layer."""
        import copy

        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        model = copy.deepcopy(self.hf)
        own = dict(model.named_parameters())
        scale = float(config["lora_alpha"]) / float(config["r"])
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                weight = own[f"{module}.weight"]
                weight.add_((scale * (b.float() @ a.float())).to(weight.dtype))
        self.adapters[lora_id] = model

    @torch.no_grad()
    def corrupt_at(self, version: str | None) -> None:
        """The judge's `--corrupt VERSION:NAME:DELTA`: once version VERSION is loaded, add DELTA to every element
        of parameter NAME (a server whose weights went wrong after a publication)."""
        if self.corruption is None or version != self.corruption[0] or self.hf is None:
            return
        _, name, delta = self.corruption
        self.hf.state_dict()[name].add_(delta)
        self.record(_Corrupted(version=version, name=name, delta=delta))


class SGLangView(torch.nn.Module):
    """The stand-in model as SGLang's `WeightExporter` sees it: see the module docstring."""

    stacked_params_mapping = STACKED_PARAMS_MAPPING

    def __init__(self, model: StandInModel) -> None:
        super().__init__()
        self.standin = model
        self.config = model.hf.config
        self.model = model.hf.model  # SGLang's classes read `self.model.embed_tokens` (tied lm_head)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The Hugging Face parameters under SGLang's names, fused tensors concatenated in SGLang's order."""
        own = dict(self.standin.hf.named_parameters())
        fused: dict[str, list[torch.Tensor]] = {}
        for name, tensor in own.items():
            for param_name, shard_name, _ in self.stacked_params_mapping:
                if shard_name in name:
                    fused.setdefault(name.replace(shard_name, param_name), []).append(tensor)
                    break
            else:
                yield name, tensor
        for name, parts in fused.items():
            yield name, torch.nn.Parameter(torch.cat(parts, dim=0), requires_grad=False)


def sglang_view(model: StandInModel, model_config: Any) -> torch.nn.Module:
    """An `SGLangView` of the class SGLang's registry resolves for the checkpoint (`get_model_architecture`)."""
    from sglang.srt.model_loader.utils import get_model_architecture

    model_cls, _ = get_model_architecture(model_config)
    if model.hf is None:  # no checkpoint: nothing to export
        return torch.nn.Module()
    own = {"get_weights_by_name": model_cls.get_weights_by_name} if hasattr(model_cls, "get_weights_by_name") else {}
    return type(model_cls.__name__, (SGLangView,), own)(model)


class _Loaded:
    """Record entry: the tensors SGLang's `WeightUpdater` handed the model to load."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class _Corrupted(_Loaded):
    """Record entry: the judge's `--corrupt` changed a parameter."""
