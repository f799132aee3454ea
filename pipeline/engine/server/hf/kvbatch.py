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

* decode: the batch keeps one `DynamicCache` across steps (`decode_inputs`), whose full-attention
  layers hold their keys and values in buffers with `SPARE_COLUMNS` free columns, and the attention
  mask likewise: a step writes its token's column in place. Why: wrapping the tensors in a fresh
  `DynamicCache` each step copies the whole cache (its `update` concatenates), and the layer's own
  `update` copies it again to append one column; on small models those copies were a fifth of a
  step. Layers of other kinds (sliding windows) keep transformers' own update.

Between steps the batch's KV is per-layer (key, value) views [B, kv_heads, L, head_dim] (`kv`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]
SPARE_COLUMNS = 32
"""Free columns allocated past the current width (KV buffers and mask): a reallocation every 32 steps, not every one."""


class KVBatch:
    """Rows of left-padded KV and their attention mask [B, L] (int64, 1 = real token)."""

    def __init__(self, kv: KV, mask: torch.Tensor) -> None:
        self._kv = kv
        self.mask = mask
        self._mask_buffer: torch.Tensor | None = None
        self._cache: Any = None  # the decode steps' cache, made by the first one

    @property
    def kv(self) -> KV:
        return cache_tensors(self._cache) if self._cache is not None else self._kv

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def lengths(self) -> torch.Tensor:
        """Real tokens per row [B, 1]: the position id of each row's next token."""
        return self.mask.sum(dim=1, keepdim=True)

    def decode_inputs(self, config: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(attention mask, position ids, cache) of a forward pass feeding one new token per row.

        The mask gets the new tokens' column at once; the cache is the batch's own, which the forward
        pass extends in place, so `kv` includes the new column afterwards.
        """
        positions = self.lengths()
        if self._cache is None:
            self._cache = spare_cache(self._kv, config)
            self._kv = []
        width = self.width
        if self._mask_buffer is None or self._mask_buffer.shape[1] <= width:
            self._mask_buffer = self.mask.new_zeros(self.rows, width + 1 + SPARE_COLUMNS)
            self._mask_buffer[:, :width] = self.mask
        self._mask_buffer[:, width] = 1
        self.mask = self._mask_buffer[:, : width + 1]
        return self.mask, positions, self._cache

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


class _SpareLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values sit in buffers with free columns: `update` writes in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self._key_buffer, self._value_buffer = _spare(keys), _spare(values)
        self._length = keys.shape[2]
        self.keys = self._key_buffer[:, :, : self._length]
        self.values = self._value_buffer[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:  # full: move to bigger buffers
            used = slice(0, self._length)
            self._key_buffer = _spare(self._key_buffer[:, :, used], end)
            self._value_buffer = _spare(self._value_buffer[:, :, used], end)
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        self._length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values


def spare_cache(kv: KV, config: Any) -> Any:
    """A `DynamicCache` holding `kv` whose full-attention layers grow in place (`_SpareLayer`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(kv) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return dynamic_cache(kv, config)  # sliding windows or shared layers: transformers' own layers
    cache.layers = [_SpareLayer(k, v) for k, v in kv]
    return cache


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


def _spare(t: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """A buffer holding `t` [B, H, L, D] in its first L columns, with room for `length` + SPARE_COLUMNS."""
    width = t.shape[2]
    buffer = t.new_empty(t.shape[0], t.shape[1], max(length or width, width) + SPARE_COLUMNS, t.shape[3])
    buffer[:, :, :width] = t
    return buffer
