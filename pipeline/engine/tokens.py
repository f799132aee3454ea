"""Token-level shapes both sides of the engine protocol share: servers produce them, the client parses them."""

from __future__ import annotations

TopEntry = list[tuple[float, int]]
"""The top logprobs of one output position: (logprob, token id), most likely first
(`meta_info.output_top_logprobs` in docs/inference.md)."""


def version_spans(versions: list[int]) -> list[list[int]]:
    """Per-token weight versions in run-length form, arl's `meta_info.weight_version_spans`:
    `[[first token index, version], ...]`, one entry per change.

    `[[0, 3], [17, 4]]`: tokens 0-16 were sampled by version 3, tokens from 17 on by version 4 (a request
    paused across a weight update). Indices count from the completion's first token, in streams too.
    """
    spans: list[list[int]] = []
    for index, version in enumerate(versions):
        if not spans or spans[-1][1] != version:
            spans.append([index, int(version)])
    return spans


def expand_spans(spans: object, count: int) -> list[int]:
    """The inverse of `version_spans` for `count` tokens; ValueError naming the problem when malformed."""
    if not isinstance(spans, list) or bool(spans) != bool(count):
        raise ValueError(f"weight_version_spans must list [index, version] for {count} tokens, got {spans!r}")
    starts: list[int] = []
    for i, span in enumerate(spans):
        shaped = isinstance(span, list) and len(span) == 2 and all(type(x) is int and x >= 0 for x in span)
        if not shaped or span[0] >= count or (span[0] != 0 if i == 0 else span[0] <= starts[-1]):
            raise ValueError(f"weight_version_spans[{i}] = {span!r} is not an increasing [index < {count}, version]")
        starts.append(span[0])
    ends = [*starts[1:], count] if starts else []
    return [span[1] for span, end in zip(spans, ends, strict=True) for _ in range(end - span[0])]
