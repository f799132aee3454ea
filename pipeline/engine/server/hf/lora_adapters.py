"""The `hf` engine's LoRA adapters: SGLang's `/load_lora_adapter` routes, each request served by the adapter it names.

An adapter is a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`). Loading one checks it against
the served model (every adapted module a linear layer of it, every matrix the right shape; no DoRA, no embedding
adapters, no extra trained modules) before anything changes, and keeps its matrices beside the base weights, which
it never touches. A forward hook on each adapted linear layer adds `scale * B(A(x))` (PEFT's own arithmetic and
order) to the rows of the batch whose request named that adapter (`/generate`'s `lora_path`), so requests of
several adapters and of the base share a batch, as in SGLang, and a request keeps its adapter for its whole life:
a new version loaded under a new name never changes what an older request runs on.

Why unmerged: merging the newest adapter into the weights would move every request in flight onto it, and the
requests of the previous version (the proxy names it until the new one is announced) could not be served at all.
The price: each adapted layer does two small matmuls more per step for the rows that use an adapter.

Threads: loading reads the files on the caller's thread; registering, unregistering and the per-step row
assignment (`rows`) happen on the scheduler thread only (the hooks read them during the forward pass).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.server.hf.sequences import Seq
from pipeline.engine.server.requests import RequestError
from schemas.engine_api import lora_adapter_version

_PREFIX = "base_model.model."
"""What PEFT puts in front of the base model's module names in a saved adapter."""


@dataclass
class Adapter:
    """One loaded adapter: per adapted module, its (A [r, in], B [out, r]) in the model's dtype and device."""

    name: str
    path: str
    scale: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    version: int | None = None
    """The run's weight version when the name is arl's (`lora_adapter_name`); tokens it samples carry it."""
    retiring: bool = False
    """Being unloaded: refuses new requests, waits for those it serves."""


class LoraAdapters:
    """The adapters a model serves and the hooks that apply them (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []
        self._hooks: dict[str, Any] = {}

    # -- loading (caller's thread: files; scheduler thread: registering) ------------------------
    def read(self, name: str, path: str) -> Adapter:
        """The adapter at `path`, checked against the model; a `RequestError` naming the problem otherwise."""
        directory = Path(path)
        config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise RequestError(
                f"lora_path {path!r} is not a PEFT adapter directory (needs adapter_config.json and "
                "adapter_model.safetensors)"
            )
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise RequestError(f"{config_file}: not JSON ({exc})") from None
        scale = _scale(config, config_file)
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
        layers = _layers(self.model, tensors, weights_file)
        return Adapter(name, str(directory.resolve()), scale, layers, lora_adapter_version(name))

    def register(self, adapter: Adapter) -> None:
        """Serve `adapter` from now on (scheduler thread); a name already loaded is refused, as in SGLang."""
        if adapter.name in self.adapters:
            raise RequestError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it first")
        self.adapters[adapter.name] = adapter
        modules = dict(self.model.named_modules())
        for module_name in adapter.layers:
            if module_name not in self._hooks:
                self._hooks[module_name] = modules[module_name].register_forward_hook(self._hook(module_name))

    def unregister(self, name: str) -> None:
        """Drop adapter `name` and the hooks no loaded adapter needs (scheduler thread)."""
        self.adapters.pop(name, None)
        needed = {m for a in self.adapters.values() for m in a.layers}
        for module_name in [m for m in self._hooks if m not in needed]:
            self._hooks.pop(module_name).remove()

    def get(self, name: str) -> Adapter:
        """The adapter a request names; a `RequestError` for an unknown or retiring one."""
        adapter = self.adapters.get(name)
        if adapter is None or adapter.retiring:
            state = "is being unloaded" if adapter is not None else "is not loaded"
            raise RequestError(f"lora_path {name!r} {state}; loaded adapters: {sorted(self.loaded())}")
        return adapter

    def loaded(self) -> dict[str, str]:
        """Name -> directory of every adapter serving requests (SGLang's `loaded_adapters`)."""
        return {n: a.path for n, a in self.adapters.items() if not a.retiring}

    # -- serving (scheduler thread) ----------------------------------------------------------------
    @contextmanager
    def rows(self, adapters: list[Adapter | None]) -> Iterator[None]:
        """During one forward pass, row i of the batch is served by `adapters[i]` (None: the base model)."""
        used = {id(a): a for a in adapters if a is not None}
        if not used:
            yield
            return
        if len(used) == 1 and all(a is not None for a in adapters):
            self._groups = [(next(iter(used.values())), None)]  # the whole batch: no row selection
        else:
            device = next(self.model.parameters()).device
            self._groups = [
                (a, torch.tensor([i for i, b in enumerate(adapters) if b is a], device=device)) for a in used.values()
            ]
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, module_name: str) -> Any:
        def add_adapters(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = args[0]
            for adapter, index in self._groups:
                pair = adapter.layers.get(module_name)
                if pair is None:
                    continue
                a, b = pair
                if index is None:  # PEFT: result + lora_B(lora_A(x)) * scaling
                    output = output + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * adapter.scale
                else:
                    rows = x.index_select(0, index)
                    delta = torch.nn.functional.linear(torch.nn.functional.linear(rows, a), b) * adapter.scale
                    output = output.index_add(0, index, delta)
            return output

        return add_adapters


def serving(lora: LoraAdapters | None, seqs: list[Seq]) -> AbstractContextManager[None]:
    """The forward pass over `seqs` (one batch row each, in order) applies each one's adapter."""
    if lora is None or all(s.req.lora is None for s in seqs):
        return nullcontext()
    return lora.rows([s.req.lora for s in seqs])


def _scale(config: dict[str, Any], where: Path) -> float:
    """`lora_alpha / r` (`/ sqrt(r)` with rsLoRA); a `RequestError` for what this engine cannot apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"{where}: peft_type {config.get('peft_type')!r} is not LoRA")
    refused = [k for k in ("use_dora", "fan_in_fan_out") if config.get(k)]
    if config.get("modules_to_save"):
        refused.append("modules_to_save")
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config.get('bias')}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        refused.append("rank_pattern/alpha_pattern")
    if refused:
        raise RequestError(f"{where}: the hf engine serves plain LoRA adapters; this one uses {', '.join(refused)}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise RequestError(
            f"{where}: needs an integer r >= 1 and a numeric lora_alpha, got r={rank!r} lora_alpha={alpha!r}"
        )
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _layers(model: Any, tensors: dict[str, torch.Tensor], where: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted module of `model`, its (A, B) from the saved tensors, cast to the module's dtype and device."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            if name.endswith(f".{part}.weight"):
                pairs.setdefault(name.removesuffix(f".{part}.weight"), {})[part] = tensor
                break
        else:
            raise RequestError(f"{where}: tensor {key!r} is not a LoRA A or B matrix of a linear layer")
    if not pairs:
        raise RequestError(f"{where}: holds no LoRA matrices")
    modules = dict(model.named_modules())
    layers = {}
    for name, pair in sorted(pairs.items()):
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            what = "no module of the served model" if module is None else f"a {type(module).__name__}"
            raise RequestError(f"{where}: adapts {name!r}, which is {what}; only linear layers can be adapted")
        if set(pair) != {"lora_A", "lora_B"}:
            raise RequestError(f"{where}: {name!r} has {sorted(pair)} only; LoRA needs both A and B")
        a, b = pair["lora_A"], pair["lora_B"]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != module.in_features
            or b.shape[0] != module.out_features
            or a.shape[0] != b.shape[1]
        ):
            raise RequestError(
                f"{where}: {name!r} has A {list(a.shape)} and B {list(b.shape)}; the served layer "
                f"maps {module.in_features} -> {module.out_features}"
            )
        weight = module.weight
        layers[name] = (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype))
    return layers
