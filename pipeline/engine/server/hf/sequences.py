"""What the `hf` engine's scheduler (`batcher.py`) keeps per request: the request and its sequence's state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pipeline.engine.server.backend import Progress
from pipeline.engine.server.hf.sampling import RowSampling
from pipeline.engine.server.requests import PromptLogprobs
from pipeline.engine.tokens import TopEntry
from schemas.engine_api import VERIFY_RID_PREFIX


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: RowSampling
    stop_token_ids: set[int]
    stop_strings: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Progress]
    logprob_start_len: int = -1
    """Score the prompt from this position on (SGLang's input logprobs); -1: no."""
    lora: Any = None
    """The `lora_adapters.Adapter` serving it; None: the base model."""
    routed_experts_start: int = -1
    """Return the experts each token was routed to from this position on (`return_routed_experts`); -1: no."""
    stream: bool = True
    """Deliver each step's tokens as they come; False: one event when the request finishes (nobody reads the
    intermediate ones, and each costs the event loop a wake-up per token while it shares the CPU with the model)."""


@dataclass
class Seq:
    """One request's sequence in the scheduler: its output so far and what was sent of it."""

    req: GenRequest
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each output token (a request paused across a swap holds two)."""
    top: list[TopEntry] = field(default_factory=list)
    emitted: int = 0
    finish: dict[str, Any] | None = None
    prompt: PromptLogprobs | None = None
    """The scored prompt, once computed (a retracted request keeps it: it is not scored twice)."""
    prompt_sent: bool = False
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (`prefix_cache.py`) rather than the prefill."""
    cache_epoch: int = -1
    """The prefix cache's epoch when this sequence's KV was computed: stored at the end only if unchanged."""
    routed: Any = None
    """`[positions, layers, top_k]` int32: the experts of each token fed so far (routing.py); None unless asked."""

    def version_now(self, current: int) -> int:
        """The version a token sampled now comes from: its adapter's (arl's adapter names carry one), else the
        served weights' `current`."""
        version = getattr(self.req.lora, "version", None)
        return current if version is None else int(version)


def is_probe(seq: Seq) -> bool:
    """The trainer's verification probe: the one request run while generation is paused."""
    return seq.req.rid.startswith(VERIFY_RID_PREFIX) and seq.req.max_new_tokens == 0 and wants_prompt_scored(seq)


def wants_prompt_scored(seq: Seq) -> bool:
    return seq.req.logprob_start_len >= 0 and seq.prompt is None


def finish_of(seq: Seq, token: int, tokenizer: Any, max_context: int) -> dict[str, Any] | None:
    """SGLang's `finish_reason` once `token` (just sampled) ends the sequence, else None."""
    req = seq.req
    if token in req.stop_token_ids:
        return {"type": "stop", "matched": token}
    if req.stop_strings:
        window = max(len(s) for s in req.stop_strings) * 4 + 4  # a token holds >= 1 byte of text
        tail = tokenizer.decode(seq.output[-window:], skip_special_tokens=False)
        for stop in req.stop_strings:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if len(seq.output) >= req.max_new_tokens or len(req.input_ids) + len(seq.output) >= max_context:
        return {"type": "length", "length": len(seq.output)}
    return None


def next_progress(seq: Seq, weight_version: int, routed_experts: str | None) -> Progress:
    """What `seq` produced since its last event (`weight_version`: the served weights now)."""
    start, seq.emitted = seq.emitted, len(seq.output)
    prompt = None if seq.prompt_sent else seq.prompt
    seq.prompt_sent = seq.prompt_sent or prompt is not None
    return Progress(
        seq.output[start:],
        seq.logprobs[start:],
        weight_version,
        seq.finish,
        seq.top[start:],
        prompt,
        new_versions=seq.versions[start:],
        cached_tokens=seq.cached_tokens,
        routed_experts=routed_experts,
    )


def deliver(items: list[tuple[asyncio.Queue[Progress], Progress]]) -> None:
    """Put events on their requests' queues (run on each request's own event loop)."""
    for queue, event in items:
        queue.put_nowait(event)
