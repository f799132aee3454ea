"""A vLLM worker extension for arl's weight updates, called through vLLM's `/collective_rpc`.

Loaded *inside vLLM's workers* (vLLM's own venv), so it imports only the standard library, torch and
`pipeline.engine.weight_group` (torch only). vLLM mixes this class into its worker class
(`--worker-extension-cls`), so `self` is the worker: `self.model_runner`, `self.rank`, `self.device`.
`/collective_rpc` passes string arguments only, hence the JSON strings.

Why the extra step after each load: with tied embeddings the CPU build keeps a pre-packed copy of
the output layer; without re-running its `process_weights_after_loading`, generation would keep
using the old `lm_head` (measured; docs/inference.md, "vLLM").
"""

from __future__ import annotations

import json
from typing import Any


class ArlWorkerExtension:
    model_runner: Any
    rank: int
    device: Any

    def arl_reload_from_disk(self, model_path: str) -> str:
        """Load every weight from a Hugging Face directory (vLLM's in-place reload)."""
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

    def arl_receive(self, spec: str) -> str:
        """Receive named tensors from rank 0 of the group and load them in place."""
        from pipeline.engine.weight_group import receive_from_trainer

        args = json.loads(spec)
        backend = self.__dict__.get("_arl_group_backends", {}).get(args["group_name"])
        device = "cpu" if backend == "gloo" else self.device
        tensors = receive_from_trainer(self._arl_group(args["group_name"]), args["dtypes"], args["shapes"], device)
        self.model_runner.reload_weights(weights_iterator=list(zip(args["names"], tensors, strict=True)))
        self._arl_after_load()
        return f"rank {self.rank}: received {len(tensors)} tensors"

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
