"""A vLLM worker extension for arl's weight updates, called through vLLM's `/collective_rpc`.

Loaded *inside vLLM's workers* (vLLM's own venv), so it imports only the standard library, torch and
`pipeline.engine.weight_group` (torch only). vLLM mixes this class into its worker class
(`--worker-extension-cls`), so `self` is the worker: `self.model_runner`, `self.rank`, `self.device`.
`/collective_rpc` passes string arguments only, hence the JSON strings.

Why the extra step after each load: with tied embeddings the CPU build keeps a pre-packed copy of
the output layer; without re-running its `process_weights_after_loading`, generation would keep
using the old `lm_head` (measured; docs/inference.md, "vLLM").

Broadcast updates come as a session (SGLang's begin / buckets / end), loaded the way vLLM's own NCCL
weight-transfer engine loads them: `arl_begin_update` starts vLLM's layerwise reload, each
`arl_receive` feeds its bucket to `load_weights` (a layer is processed and swapped in once all its
weights arrived), `arl_end_update` finishes it. One `reload_weights` per bucket would not do: it
finishes every layer at the end of each call, and a layer whose weights span two buckets (q in one,
k and v in the next) came out wrong (measured). No request may run during a session: the layers
being replaced are on the meta device until they are complete.

`arl_weights_by_name` answers SGLang's `/get_weights_by_name` for a Hugging Face parameter name: vLLM
fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (the model's `packed_modules_mapping`),
so a part is sliced out of the fused rows by the layer's `output_sizes`; a tied `lm_head.weight` is the
embedding. vLLM's CPU build drops a linear layer's weight once it has packed it for its GEMM kernel
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`); there the rows are read back through that
kernel, on identity inputs: each output is one weight times 1 plus zeros, so the rows come back
exactly, and they are the weights the kernel computes with (not a copy that could be stale).
"""

from __future__ import annotations

import json
from typing import Any


class ArlWorkerExtension:
    model_runner: Any
    rank: int
    device: Any
    vllm_config: Any

    def arl_reload_from_disk(self, model_path: str) -> str:
        """Load every weight from a Hugging Face directory (vLLM's in-place reload)."""
        if self.__dict__.get("_arl_updating"):
            raise RuntimeError(f"rank {self.rank}: a broadcast weight update is open; end it first")
        self.model_runner.reload_weights(weights_path=model_path)
        self._arl_after_load()
        return f"rank {self.rank}: reloaded {model_path}"

    def arl_init_group(self, spec: str) -> str:
        """Join the trainer's broadcast group as rank `rank_offset + this worker's rank`."""
        from pipeline.engine.weight_group import init_weight_group

        args = json.loads(spec)
        groups = self.__dict__.setdefault("_arl_groups", {})
        rank = int(args["rank_offset"]) + int(self.rank)
        groups[args["group_name"]] = init_weight_group(
            args["master_address"],
            int(args["master_port"]),
            rank=rank,
            world_size=int(args["world_size"]),
            group_name=args["group_name"],
            backend=args["backend"],
        )
        # The receive call does not repeat the backend, and a gloo group receives into CPU tensors
        # whatever device this worker computes on: remember it per group.
        self.__dict__.setdefault("_arl_group_backends", {})[args["group_name"]] = args["backend"]
        return f"rank {rank} joined {args['group_name']}"

    def arl_destroy_group(self, group_name: str) -> str:
        """Leave (destroy) a broadcast group joined with `arl_init_group`."""
        from pipeline.engine.weight_group import destroy_weight_group

        destroy_weight_group(self._arl_group(group_name))
        del self.__dict__["_arl_groups"][group_name]
        self.__dict__.get("_arl_group_backends", {}).pop(group_name, None)
        return f"rank {self.rank} left {group_name}"

    def arl_begin_update(self) -> str:
        """Open a weight-update session: start vLLM's layerwise reload, which the buckets feed."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.__dict__.get("_arl_updating"):
            raise RuntimeError(f"rank {self.rank}: a weight update is already open")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self.__dict__["_arl_updating"] = True
        return f"rank {self.rank}: update open"

    def arl_receive(self, spec: str) -> str:
        """Receive named tensors from rank 0 of the group and load them (inside a session)."""
        from vllm.config import set_current_vllm_config

        from pipeline.engine.weight_group import receive_from_trainer

        if not self.__dict__.get("_arl_updating"):
            raise RuntimeError(f"rank {self.rank}: no weight update open (arl_begin_update first)")
        args = json.loads(spec)
        backend = self.__dict__.get("_arl_group_backends", {}).get(args["group_name"])
        device = "cpu" if backend == "gloo" else self.device
        tensors = receive_from_trainer(self._arl_group(args["group_name"]), args["dtypes"], args["shapes"], device)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(list(zip(args["names"], tensors, strict=True)))
        return f"rank {self.rank}: received {len(tensors)} tensors"

    def arl_end_update(self) -> str:
        """Close the session: finish every layer (those no bucket touched keep their weights)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.__dict__.pop("_arl_updating", False):
            raise RuntimeError(f"rank {self.rank}: no weight update open")
        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), runner.model_config)
        self._arl_after_load()
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            getattr(runner, reset, lambda: None)()
        return f"rank {self.rank}: update closed"

    def arl_weights_by_name(self, spec: str) -> list[Any]:
        """The first `truncate_size` rows (elements of a vector) of a parameter, by its Hugging Face name."""
        args = json.loads(spec)
        if self.__dict__.get("_arl_updating"):
            raise RuntimeError(f"rank {self.rank}: a weight update is open; its layers are being replaced")
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            raise RuntimeError("weights by name are not supported with tp_size > 1 (each worker holds a shard)")
        return _hf_rows(self.model_runner.get_model(), args["name"], int(args["truncate_size"]))

    def _arl_group(self, name: str) -> Any:
        group = self.__dict__.get("_arl_groups", {}).get(name)
        if group is None:
            raise ValueError(f"no weight update group {name!r} on worker {self.rank}")
        return group

    def _arl_after_load(self) -> None:
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)


def _hf_rows(model: Any, name: str, truncate_size: int) -> list[Any]:
    """`param.float().tolist()[:truncate_size]` of the HF parameter `name` as this vLLM model serves it."""
    import torch

    params = dict(model.named_parameters())
    if name == "lm_head.weight" and name not in params and getattr(model.config, "tie_word_embeddings", False):
        name = "model.embed_tokens.weight"  # tied: one tensor, registered under the embedding's name
    rows = slice(None)
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        for index, part in enumerate(parts):
            if f".{part}." in name:
                name = name.replace(f".{part}.", f".{fused}.")
                sizes = model.get_submodule(name.rsplit(".", 1)[0]).output_sizes
                rows = slice(sum(sizes[:index]), sum(sizes[: index + 1]))
    if name not in params:
        raise KeyError(f"{name!r} is not a parameter of the served vLLM model")
    layer = model.get_submodule(name.rsplit(".", 1)[0])
    tensor = params[name]
    if tensor.numel() == 0 and name.endswith(".weight") and hasattr(layer, "cpu_linear"):
        tensor = _packed_weight(layer, tensor.dtype, tensor.device)
    if hasattr(layer, "org_vocab_size"):  # an embedding / lm head: drop the vocabulary padding
        tensor = tensor[: layer.org_vocab_size]
    with torch.no_grad():
        return tensor[rows][:truncate_size].float().cpu().tolist()


def _packed_weight(layer: Any, dtype: Any, device: Any) -> Any:
    """A CPU linear layer's (out, in) weight, read back through its packed GEMM kernel (module docstring)."""
    import torch

    with torch.no_grad():
        eye = torch.eye(layer.input_size_per_partition, dtype=dtype, device=device)
        return layer.cpu_linear(eye, layer.weight, None).t()
