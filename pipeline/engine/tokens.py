"""Token-level shapes both sides of the engine protocol share: servers produce them, the client parses them."""

from __future__ import annotations

TopEntry = list[tuple[float, int]]
"""The top logprobs of one output position: (logprob, token id), most likely first
(`meta_info.output_top_logprobs` in docs/inference.md)."""
