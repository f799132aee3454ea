"""What the `vllm` backend's adapter reads from the served checkpoint without loading it (vLLM holds the
weights): tensor names and shapes, to vet weight updates up front, and the EOS ids that end completions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.engine.server.weights import eos_token_ids


def checkpoint_eos_ids(model_dir: Path, hf_config: dict[str, Any], tokenizer: Any) -> set[int]:
    """The EOS ids of config.json and generation_config.json (which end vLLM's completions too, as they do
    the hf engine's), read as the hf engine reads them from a loaded model."""
    return eos_token_ids(_ConfigView(hf_config, _generation_config(model_dir)), tokenizer)


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor names and shapes of a HF checkpoint (headers only): to vet distributed updates up front."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


class _ConfigView:
    """Just enough of a model for `eos_token_ids`."""

    def __init__(self, hf_config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> None:
        self.config = type("C", (), {"eos_token_id": hf_config.get("eos_token_id")})()
        self.generation_config = (
            type("G", (), {"eos_token_id": generation_config.get("eos_token_id")})() if generation_config else None
        )


def _generation_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None
