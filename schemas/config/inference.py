"""`inference:` — the inference servers (SGLang protocol) the proxy and trainer talk to."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Block


class InferenceConfig(Block):
    backend: Literal["hf", "vllm", "sglang"] = "hf"
    """`hf` = the embedded transformers engine; `vllm` / `sglang` launch those servers with their own CLIs."""
    num_servers: int = Field(1, ge=1)
    """Servers started by one inference job (each on its own port on the job's node)."""
    host: str = "127.0.0.1"
    """Interface the servers bind to; use `0.0.0.0` on a cluster so other nodes reach them."""
    port: int = Field(0, ge=0, le=65535)
    """First port to try; 0 picks free ports."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the `hf` engine; `auto` = CUDA when available."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences the `hf` engine decodes in one step (dynamic batching)."""
    tp_size: int = Field(1, ge=1)
    """Tensor parallel size of a `vllm` / `sglang` server."""
    mem_fraction: float = Field(0.85, gt=0, le=1)
    """GPU memory fraction for a `vllm` / `sglang` server's KV cache."""
    python: str | None = None
    """Python interpreter that runs `vllm` / `sglang` (e.g. a separate venv); `None` = this one."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed verbatim to the `vllm` / `sglang` server."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Deadline for a server to become healthy."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Per-request deadline in the engine client."""
    batch_window_ms: float = Field(0.0, ge=0, le=100)
    """> 0: the proxy gathers the completions it sends one server over this many milliseconds (at most
    `max_batch_size` of them) into one batched `/generate` request, SGLang's batch form; streamed calls are
    never gathered. It saves the per-request HTTP work, which dominates short completions on a small machine,
    and couples latencies: a batch is answered when its longest completion ends. For short, similar
    completions (docs/inference.md, "Batching requests"); 0 = one request per completion."""
    min_servers: int | None = Field(None, ge=1)
    """A new weight version is announced (and generation resumed) once this many servers verified it;
    `None` = every server that took part in the swap, so a server taken out must come back (restarted by
    the inference stage) and verify the version first. Lower it to trade atomicity for availability."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per server by the inference stage (after a crash, or when the trainer took it out because a
    weight swap failed its verification); past this a server stays down."""
    update_mode: Literal["wait", "interrupt"] = "interrupt"
    """What a weight publication does with the requests in flight. `interrupt` (partial rollouts): generation
    is paused, the weights are swapped and verified, and the same requests continue under the new version
    (their tokens carry both versions). `wait`: the requests in flight finish under the old weights first
    while new ones wait; no completion spans two versions, and the servers idle for the longest one."""
    pause_mode: Literal["retract", "in_place"] = "retract"
    """With `update_mode: interrupt`: `retract` recomputes the paused requests' KV cache from their tokens
    under the new weights; `in_place` keeps the KV cache the old weights computed (cheaper, slightly off the
    new policy; SGLang's `in_place`, vLLM's `keep`)."""
    prefix_cache_mb: int = Field(256, ge=0)
    """`hf` engine: memory for the KV cache of finished requests, reused by a later request that starts with
    the same tokens (an agent's next turn prefills only its new suffix); least recently used entries are
    evicted past it, everything is dropped at a weight update; 0 = off."""


# Flags that add ranks the weight-broadcast group does not count (it holds the trainer and every server's
# tensor-parallel ranks, nothing else), per backend: full name -> the shortest form its parser accepts.
# SGLang's argparse takes any unambiguous prefix; vLLM takes its full names and the short aliases.
_REPLICA_FLAGS: dict[str, dict[str, str]] = {
    "sglang": {
        "--dp-size": "--dp",
        "--data-parallel-size": "--data-p",
        "--pp-size": "--pp-s",
        "--pipeline-parallel-size": "--pipeline-p",
    },
    "vllm": {
        "--data-parallel-size": "--data-parallel-size",
        "-dp": "-dp",
        "--pipeline-parallel-size": "--pipeline-parallel-size",
        "-pp": "-pp",
    },
}


def replica_flags(backend: str, extra_args: list[str]) -> list[tuple[str, str]]:
    """(flag as written, value) for each data- or pipeline-parallel size above 1 in the server's `extra_args`."""
    names = _REPLICA_FLAGS.get(backend, {})
    found = []
    for i, arg in enumerate(extra_args):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = extra_args[i + 1] if i + 1 < len(extra_args) else ""
        is_replica = any(name.startswith(flag) and flag.startswith(short) for name, short in names.items())
        if is_replica and value.isdigit() and int(value) > 1:  # anything else is for the engine's parser to refuse
            found.append((flag, value))
    return found
