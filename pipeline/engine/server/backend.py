"""What a backend gives the engine's HTTP app (`app.py`): the `EngineBackend` Protocol.

The app owns the protocol (routes, body parsing, error bodies, response shapes; docs/inference.md);
a backend only generates tokens and carries out control and weight-update commands. Two implement
it: `hf.engine.HFEngine` (a transformers model in this process) and `vllm.adapter.VLLMAdapter`
(a vLLM server behind us).

Errors: a backend raises `requests.RequestError` when the caller's input cannot be served (the app
answers 400); anything else is a failure (500, or 502 for an adapter: see `failure_status`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.engine.server.requests import Limits, PromptLogprobs, WorkItem
from pipeline.engine.tokens import TopEntry
from schemas.engine_api import (
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
)


@dataclass
class Progress:
    """Tokens a completion produced since its previous event."""

    new_ids: list[int]
    new_logprobs: list[float]
    weight_version: int
    """The weights that produced these tokens (streamed chunks carry it)."""
    finish: dict[str, Any] | None = None
    """SGLang's `finish_reason` on the last event of a completion, else None."""
    new_top: list[TopEntry] = field(default_factory=list)
    """Top logprobs of the new tokens (empty unless the request set `top_logprobs_num`)."""
    prompt: PromptLogprobs | None = None
    """The scored prompt (`logprob_start_len` >= 0), on the first event of a completion only."""
    new_versions: list[int] | None = None
    """Per new token, the weight version that sampled it; None: every one `weight_version`."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (SGLang's `meta_info.cached_tokens`)."""
    routed_experts: str | None = None
    """On the last event of a completion that asked (`return_routed_experts`): SGLang's `meta_info.routed_experts`."""

    def versions(self) -> list[int]:
        """The weight version of each new token."""
        return list(self.new_versions) if self.new_versions is not None else [self.weight_version] * len(self.new_ids)


@dataclass(frozen=True)
class Check:
    """The outcome of a health check or a cache flush."""

    ok: bool
    message: str | None = None
    """Health: why it is not ok (None: no reason known: the answer is a bare 503). Flush: the answer's text."""


def model_info_body(model_path: str, tokenizer_path: str, weight_version: int, limits: Limits) -> dict[str, Any]:
    """What every backend's `/model_info` holds (SGLang's fields; a backend may add its own)."""
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(weight_version),
        "max_context": limits.max_context,
        "context_length": limits.max_context,
        "vocab_size": limits.vocab_size,
    }


class EngineBackend(Protocol):
    """A token generator with SGLang's control and weight-update commands (see the module docstring)."""

    limits: Limits
    """Vocabulary size and context length, which every prompt is checked against."""
    tokenizer: Any
    """Turns `text` prompts into ids and output ids into `text`."""
    requests_total: int
    """`/generate` calls so far (the app counts them; `hf` reports them in its server info)."""
    incremental_stream: bool
    """Streams send deltas instead of SGLang's default cumulative events."""
    failure_status: int
    """HTTP status of an unexpected error: 500 for an engine that failed itself, 502 for an adapter,
    whose unexpected errors are its upstream's."""
    serves_input_logprobs: bool
    """Scores prompts (`logprob_start_len` >= 0: `Progress.prompt`); if False the app refuses such a request."""

    @property
    def weight_version(self) -> int:
        """The version of the weights new tokens come from."""
        ...

    def generate(self, item: WorkItem, *, stream: bool) -> AsyncGenerator[Progress, None]:
        """The progress of one completion, ending with the event that carries its `finish`.

        `stream` says whether the caller streams (a backend may ask its upstream for one answer
        instead). Closing the iterator early (the client went away) aborts the completion.
        """
        ...

    async def health(self, *, generate: bool) -> Check:
        """Whether the backend serves (`generate`: also that a 1-token generation finishes)."""
        ...

    async def abort(self, rid: str | None, message: str) -> None:
        """End the completion `rid` (and its `n` > 1 samples `<rid>_<i>`), or every one if None."""
        ...

    async def pause(self, mode: str) -> str:
        """Hold generation (`mode`: abort, in_place or retract); returns the answer's message."""
        ...

    async def resume(self) -> None:
        """Undo `pause`."""
        ...

    async def flush_cache(self) -> Check:
        """Drop the prefix cache."""
        ...

    async def update_from_disk(self, model_path: str, version: int | None, abort_all: bool) -> str:
        """Load the weights of a Hugging Face directory; returns the answer's message."""
        ...

    async def join_group(self, body: InitWeightsUpdateGroupReqInput) -> str:
        """Join the trainer's weight-broadcast group (blocks until every rank has joined)."""
        ...

    async def begin_update(self) -> None:
        """`/begin_weight_update`: prepare for `update_from_group` calls (the app opened the session)."""
        ...

    async def update_from_group(self, body: UpdateWeightsFromDistributedReqInput, version: int | None) -> str:
        """Receive named tensors broadcast by the group's rank 0 and load them (only inside a session).

        `version` None keeps the served version: a version's buckets carry it with the last one only.
        """
        ...

    async def end_update(self) -> None:
        """`/end_weight_update`: finish what the session's buckets loaded (the app then closes the session)."""
        ...

    async def leave_group(self, group_name: str) -> str:
        """Leave (destroy) a weight-broadcast group."""
        ...

    async def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """SGLang's `/get_weights_by_name`: `param.float().cpu().tolist()[:truncate_size]` of the served
        parameter with that Hugging Face name (a tied `lm_head.weight`: the embedding), read consistently
        with weight updates (never half-way through one). An unknown name is a `RequestError`."""
        ...

    def loaded_adapters(self) -> dict[str, str]:
        """The LoRA adapters requests may name (`lora_path`): name -> directory."""
        ...

    async def load_lora_adapter(self, body: LoadLoRAAdapterReqInput) -> dict[str, str]:
        """Load a PEFT adapter under a new name (a `RequestError` if it cannot serve it); returns `loaded_adapters`."""
        ...

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterReqInput) -> dict[str, str]:
        """Stop serving an adapter once the requests it serves finished; returns `loaded_adapters`."""
        ...

    async def update_weight_version(self, body: UpdateWeightVersionReqInput, version: int) -> str:
        """Relabel the served weights `version` (nothing is loaded); returns the answer's message."""
        ...

    def model_info(self) -> dict[str, Any]:
        """The body of `/model_info`."""
        ...

    def server_info(self) -> dict[str, Any]:
        """The body of `/server_info`."""
        ...
