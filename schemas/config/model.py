"""`model:` — which weights and tokenizer the whole run serves and trains."""

from __future__ import annotations

from typing import Literal

from schemas.config.base import Block


class ModelConfig(Block):
    path: str = "runs/tiny-model"
    """Hugging Face model directory (config.json, safetensors, tokenizer) of the initial policy (version 0)."""
    tokenizer: str | None = None
    """Tokenizer directory; `None` means the model directory."""
    served_name: str = "arl-policy"
    """Model name the proxy reports in `/v1/models` and in responses."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for inference and for the trainer's master weights on CPU."""
    max_context: int = 2048
    """Longest token sequence (prompt + completion) the run allows."""
    tool_parser: str = "hermes"
    """Name of the parser that turns generated text into tool calls (`hermes`, `llama3_json`, `none`)."""
    reasoning_parser: str = "think"
    """Name of the parser that splits reasoning from the answer (`think` = `<think>...</think>`, `none`)."""
    chat_template: str | None = None
    """Path to a Jinja chat template overriding the tokenizer's own."""
