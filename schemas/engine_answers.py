"""Response bodies of the inference servers' routes (docs/inference.md), as published in their `/openapi.json`.

The servers build these bodies as plain dicts (`pipeline.engine.server.requests.response` and the app);
the models here are their documented contract, checked against real answers by the fuzz suite
(Schemathesis' response-schema conformance). Unknown fields are allowed: SGLang adds fields between
versions, and a client must not break on one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

LogprobEntry = tuple[float | None, int, str | None]
"""`[logprob, token_id, text or null]` (the logprob is null only for the first scored prompt position)."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FinishReason(_Open):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    """`stop`: the stop token id or stop string that ended the completion."""
    length: int | None = None
    """`length`: the completion's token count."""
    message: str | None = None
    """`abort`: why it was aborted."""


class MetaInfo(_Open):
    id: str
    finish_reason: FinishReason | None
    """None in a stream's events until the last one."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_version_spans: list[list[int]] | None = None
    """arl's: `[version, first, end)` runs of the weight version each output token was sampled with."""
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResponse(_Open):
    """One completion of `POST /generate` (a batch, or `n` > 1, answers a list of these, prompt-major)."""

    text: str | None
    output_ids: list[int]
    meta_info: MetaInfo


class EngineError(BaseModel):
    """The error body of `/generate` (400), `/health` (503) and every route's 5xx (OpenAI's shape)."""

    class Detail(BaseModel):
        message: str
        type: str
        code: int

    error: Detail


class AdminAnswer(_Open):
    """SGLang's answer of the admin routes: `success` true (200) or false (the 400 or 5xx error body)."""

    success: bool
    message: str
    num_paused_requests: int | None = None
    """`/update_weights_from_disk` only (always 0: arl's engines finish or abort requests instead)."""


class LoraAnswer(_Open):
    """SGLang's answer of `/load_lora_adapter` and `/unload_lora_adapter` (its `LoRAUpdateOutput`): 200 with
    `success` true, 400 with `success` false and `error_message`; `loaded_adapters` maps each name to its path."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


class ModelInfo(_Open):
    model_path: str
    tokenizer_path: str
    is_generation: bool
    preferred_sampling_params: Any = None
    weight_version: str
    max_context: int
    context_length: int
    vocab_size: int


class ServerInfo(_Open):
    """Backend-specific (`hf` reports its scheduler's load, the vLLM adapter its upstream and gate)."""

    backend: Literal["hf", "vllm"]
    model_path: str
    tp_size: int
    dp_size: int
    weight_version: str
    paused: bool | str | None
    """`hf`: the pause mode (null: generating); the vLLM adapter: whether it is paused (mode in `pause_mode`)."""


WeightRows = list[float] | list[list[Any]]
"""`/get_weights_by_name`: the first rows of a parameter (floats for a vector, lists for a matrix)."""
