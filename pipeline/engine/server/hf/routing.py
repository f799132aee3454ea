"""The experts each token was routed to (SGLang's `return_routed_experts`), read off the model's own routers.

A mixture-of-experts layer of transformers (Qwen3-MoE, Qwen2-MoE, ...) routes with a router module returning
`(logits, weights, indices)`, the indices `[tokens, top_k]`. A forward hook on every router records them for the
forward passes of the requests that asked, in layer order; the scheduler hands each sequence its rows. A sequence
holds one `[layers, top_k]` entry per token it has fed through the model (prompt, then each sampled token but the
last), so its answer covers positions `[routed_experts_start_len, seqlen - 1)`, as SGLang's does.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def find_routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order: modules holding `top_k`, `num_experts` and a `weight` (transformers'
    top-k router classes)."""
    return [
        module
        for _, module in model.named_modules()
        if hasattr(module, "top_k")
        and hasattr(module, "num_experts")
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
    ]


@contextmanager
def capturing(routers: list[Any], wanted: bool) -> Iterator[list[torch.Tensor] | None]:
    """Record each router's chosen experts during the forward passes inside; None when not `wanted` (no hooks, no
    cost) or the model routes nothing."""
    if not wanted or not routers:
        yield None
        return
    captured: list[torch.Tensor] = []

    def record(_module: Any, _inputs: Any, output: Any) -> None:
        captured.append(output[2].detach().to(device="cpu", dtype=torch.int32))

    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def per_row(captured: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The captured indices of one forward as `[rows, columns, layers, top_k]`."""
    stacked = torch.stack(captured)  # [layers, rows * columns, top_k]
    layers, flat, top_k = stacked.shape
    return stacked.view(layers, rows, flat // rows, top_k).permute(1, 2, 0, 3)


def encoded(routed: torch.Tensor) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of the int32 array `[positions, layers, top_k]`."""
    return base64.b64encode(routed.contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


def wanted(seqs: list[Any]) -> bool:
    return any(seq.req.routed_experts_start >= 0 for seq in seqs)


def assign_prefill(captured: list[torch.Tensor] | None, seqs: list[Any]) -> None:
    """After a prefill (left-padded rows, no cached prefix for these sequences): each asking sequence's experts for
    every token it fed (its prompt and any output it had before a retraction)."""
    if not captured:
        return
    rows = per_row(captured, len(seqs))
    for row, seq in enumerate(seqs):
        if seq.req.routed_experts_start >= 0:
            fed = len(seq.req.input_ids) + len(seq.output)
            seq.routed = rows[row, rows.shape[1] - fed :].clone()


def assign_decode(captured: list[torch.Tensor] | None, seqs: list[Any]) -> None:
    """After a decode step (one token a row): each asking sequence's experts for the token it fed."""
    if not captured:
        return
    rows = per_row(captured, len(seqs))
    for row, seq in enumerate(seqs):
        if seq.req.routed_experts_start >= 0 and seq.routed is not None:
            seq.routed = torch.cat([seq.routed, rows[row]])


def answer(seq: Any) -> str | None:
    """A finished sequence's `meta_info.routed_experts` (positions from its start to `seqlen - 1`), if asked."""
    if seq.req.routed_experts_start < 0 or seq.finish is None or seq.routed is None:
        return None
    return encoded(seq.routed[seq.req.routed_experts_start :])
