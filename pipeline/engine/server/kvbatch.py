"""A left-padded, batched KV cache that sequences can join and leave between decode steps.

Continuous batching on a plain Hugging Face model: every row of the batch is one sequence; rows
are left-padded to a common length and an attention mask hides the padding. Position ids are
given explicitly (the count of real tokens before each one), so a padded row computes exactly
what the sequence would compute alone: logprobs match an unpadded teacher-forced pass to ~1e-6
in fp32.

* join: new sequences are prefilled as their own (left-padded) batch, then both caches are padded
  on the left to the same length and concatenated along the batch dimension;
* leave: a finished row is dropped with `index_select`, and columns that are padding in every
  remaining row are trimmed from the left, so one long-gone long prompt does not tax every step.

The cache is kept as plain per-layer (key, value) tensors [B, kv_heads, L, head_dim] and wrapped
in a `DynamicCache` for each forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class KVBatch:
    kv: KV
    mask: torch.Tensor  # [B, L] int64, 1 = real token

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def lengths(self) -> torch.Tensor:
        """Real tokens per row [B, 1]: the position id of each row's next token."""
        return self.mask.sum(dim=1, keepdim=True)

    def merge(self, other: KVBatch) -> KVBatch:
        """Append `other`'s rows after ours (both padded on the left to the wider width)."""
        width = max(self.width, other.width)
        kv = [
            (torch.cat([_pad_kv(k1, width), _pad_kv(k2, width)]), torch.cat([_pad_kv(v1, width), _pad_kv(v2, width)]))
            for (k1, v1), (k2, v2) in zip(self.kv, other.kv, strict=True)
        ]
        return KVBatch(kv, torch.cat([_pad_mask(self.mask, width), _pad_mask(other.mask, width)]))

    def select(self, rows: list[int]) -> KVBatch | None:
        """Keep only `rows` (in that order); None when no row is left."""
        if not rows:
            return None
        if rows == list(range(self.rows)):
            return self
        index = torch.tensor(rows, device=self.mask.device)
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
        return KVBatch(kv, self.mask.index_select(0, index)).trim_left()

    def trim_left(self) -> KVBatch:
        """Drop leading columns that are padding in every row."""
        real_cols = self.mask.any(dim=0).nonzero()
        start = int(real_cols[0]) if real_cols.numel() else self.width
        if start == 0:
            return self
        kv = [(k[:, :, start:], v[:, :, start:]) for k, v in self.kv]
        return KVBatch(kv, self.mask[:, start:])


def dynamic_cache(kv: KV | None, config: Any) -> Any:
    """A transformers `DynamicCache` holding `kv` (empty when None)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv, config=config) if kv else DynamicCache(config=config)


def cache_tensors(cache: Any) -> KV:
    """The per-layer (key, value) tensors of a `DynamicCache` after a forward pass."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) for `seqs`, left-padded to the longest."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def _pad_kv(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
