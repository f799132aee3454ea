"""The `hf` engine's prefix cache: the KV of finished requests, reused by later requests sharing their prefix.

An agent's turn k+1 prompt is turn k's prompt + its output + a short suffix; without reuse the engine
would recompute the whole history every turn. A finished request (stop or length, not aborted) leaves
its KV here: its prompt + output minus the last sampled token, which was never fed to the model. A new
request looks up the longest cached prefix of its prompt and is prefilled from there on (`prefill_inputs`);
at least one prompt token is always prefilled, since its logits sample the first new token.

Structure: a flat set of entries, each a token sequence with its own contiguous KV, and lookup by
longest common prefix over all entries, rather than a radix tree. Why: (1) the agent pattern is a
chain, each turn extending the last; inserting a sequence that extends an entry replaces that entry,
so a conversation holds one entry, however many turns it has; (2) a hit's KV is one slice of one
tensor per layer, handed to the prefill as is, where a radix tree would concatenate its nodes' pieces
at every hit; (3) eviction drops a whole conversation, the unit that goes cold. The price: branches
sharing a prefix (`n` > 1 samples of one prompt) each store that prefix.

Lookup: the entries are also kept sorted by their tokens (`_sorted`, big-endian bytes, so bytes order is
token order), and the entry sharing the longest prefix with a prompt is one of the prompt's two
neighbours in that order: a lookup is a binary search and two comparisons, however many entries there
are (a scan of every entry cost ~1 ms per request at 250 entries, a tenth of single-turn serving on a
tiny model). No entry is a prefix of another, so the entry an insert extends is its predecessor.

Memory: the entries' KV bytes stay within `budget_bytes`, least recently used (hit or inserted) first
out. Every weight update empties the cache (its KV came from the old weights), and so does
`/flush_cache`; both bump `epoch`, so a request whose KV was computed before (an `in_place` pause
across an update) is not stored when it finishes.

Who does not use it: a request that wants its prompt scored (`logprob_start_len` >= 0, the trainer's
verification probes among them) is prefilled whole, so its prompt logits are all computed. Nor does a request
served by a LoRA adapter (`lora_adapters.py`): its KV differs from the base model's, and the cache holds the
base's only.

Batching hits and misses: each row's cached KV is left-padded to the widest hit, its remaining tokens
left-padded to the longest remainder; the attention mask is [prefix mask | suffix mask], which has a
hole in the middle of rows whose hit is shorter than the widest, and position ids count each row's real
tokens (as `kvbatch.py` does). After the forward pass `close_holes` packs every row's real columns to
the right again, so the running batch stays plainly left-padded.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.engine.server.hf.kvbatch import KV, KVBatch, left_pad
from pipeline.engine.server.hf.sequences import Seq

log = logging.getLogger("arl.engine.prefix_cache")

STORED_FINISHES = ("stop", "length")
"""Finish types whose KV is kept (an aborted request's KV may be cut short or come from a failed step)."""


@dataclass
class CacheHit:
    """The first `length` tokens of a prompt, found in the cache, and their KV ([1, kv_heads, length, head_dim])."""

    length: int
    kv: KV


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 [L]
    kv: KV  # per layer (key, value), [1, kv_heads, L, head_dim], contiguous
    nbytes: int
    key: bytes  # the tokens as big-endian uint32: bytes order is token order (`_sorted`)


class PrefixCache:
    """Token-prefix → KV entries under a byte budget, LRU eviction (see the module docstring). Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.epoch = 0
        """Bumped by `clear`: KV computed in an older epoch is never stored."""
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._sorted: list[tuple[bytes, int]] = []  # (key, id) of every entry, in token order
        self._next_id = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self.lookups = 0
        self.hits = 0
        self.tokens_reused = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, tokens: Sequence[int]) -> CacheHit | None:
        """The longest cached prefix of `tokens` that leaves at least one token to compute, or None."""
        query = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            self.lookups += 1
            best_id, best = -1, 0
            pos = bisect_left(self._sorted, (_key(query),))
            for _, entry_id in self._sorted[max(pos - 1, 0) : pos + 1]:  # its neighbours in token order
                n = _common_prefix(self._entries[entry_id].tokens, query)
                if n > best:
                    best_id, best = entry_id, n
            best = min(best, len(query) - 1)
            if best <= 0:
                return None
            self._entries.move_to_end(best_id)
            self.hits += 1
            self.tokens_reused += best
            kv = self._entries[best_id].kv
        return CacheHit(best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv])

    def covered(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds all of `tokens` (inserting them would store nothing new)."""
        query = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            return self._extension_of(_key(query)) is not None

    def insert(self, tokens: Sequence[int], kv: KV) -> bool:
        """Store `kv` (contiguous, [1, kv_heads, len(tokens), head_dim] per layer) for `tokens`.

        Entries that `tokens` extends are replaced; nothing is stored when an entry already extends
        `tokens` (it is marked used instead) or when the KV alone exceeds the budget. Then the least
        recently used entries leave until the total fits. Returns whether `kv` was stored.
        """
        query = np.asarray(tokens, dtype=np.int64)
        nbytes = kv_bytes(kv)
        if not len(query) or nbytes > self.budget_bytes:
            return False
        key = _key(query)
        with self._lock:
            extension = self._extension_of(key)
            if extension is not None:  # an entry holds these tokens and maybe more
                self._entries.move_to_end(extension)
                return False
            prefix = self._prefix_of(key)
            if prefix is not None:  # replaced by its extension
                self._remove(prefix)
            self._entries[self._next_id] = _Entry(query, kv, nbytes, key)
            insort(self._sorted, (key, self._next_id))
            self._next_id += 1
            self._bytes += nbytes
            while self._bytes > self.budget_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
        return True

    def _extension_of(self, key: bytes) -> int | None:
        """The id of an entry starting with `key`'s tokens (the first in token order), or None. Under the lock."""
        pos = bisect_left(self._sorted, (key,))
        if pos < len(self._sorted) and self._sorted[pos][0].startswith(key):
            return self._sorted[pos][1]
        return None

    def _prefix_of(self, key: bytes) -> int | None:
        """The id of the entry that is a proper prefix of `key`'s tokens, or None. Under the lock.

        There is at most one, just before `key` in token order: no entry is a prefix of another (an
        insert replaces the entries it extends and is refused when an entry extends it), and every entry
        between a prefix of `key` and `key` itself would extend that prefix.
        """
        pos = bisect_left(self._sorted, (key,))
        if pos > 0 and key.startswith(self._sorted[pos - 1][0]):
            return self._sorted[pos - 1][1]
        return None

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        del self._sorted[bisect_left(self._sorted, (entry.key, entry_id))]
        self._bytes -= entry.nbytes

    def clear(self) -> tuple[int, int]:
        """Drop every entry and start a new epoch; returns (entries, bytes) dropped."""
        with self._lock:
            dropped = (len(self._entries), self._bytes)
            self._entries.clear()
            self._sorted.clear()
            self._bytes = 0
            self.epoch += 1
        return dropped

    def stats(self) -> dict[str, int]:
        """What `/server_info` reports."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "tokens": sum(len(e.tokens) for e in self._entries.values()),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
                "lookups": self.lookups,
                "hits": self.hits,
                "tokens_reused": self.tokens_reused,
                "evictions": self.evictions,
            }


def kv_bytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _key(tokens: np.ndarray) -> bytes:
    return tokens.astype(">u4").tobytes()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


# -- the scheduler's side: prefill from hits, store finished sequences -------------------------------


@dataclass
class PrefillInputs:
    """One prefill forward pass of fresh sequences, some of them starting from cached KV."""

    ids: torch.Tensor
    """[B, S] the tokens to compute, left-padded."""
    mask: torch.Tensor
    """[B, P + S] attention mask over the cached columns (P) and the computed ones; 1 = real token."""
    positions: torch.Tensor
    """[B, S] position ids: the count of real tokens before each one."""
    past: KV | None
    """Per layer [B, kv_heads, P, head_dim] the cached KV, left-padded with zeros; None when no row hit."""


def prefill_inputs(cache: PrefixCache | None, fresh: list[Seq], pad_id: int, device: torch.device) -> PrefillInputs:
    """Look up each sequence's prefix (not for those that want their prompt scored) and build the prefill.

    Sets each sequence's `cached_tokens` (prompt tokens served from the cache) and `cache_epoch`.
    """
    tokens = [s.req.input_ids + s.output for s in fresh]
    hits: list[CacheHit | None] = [None] * len(fresh)
    if cache is not None:
        for row, seq in enumerate(fresh):
            seq.cache_epoch = cache.epoch
            # a cached prefix was computed without routing capture: a request asking for its experts computes it
            if seq.req.logprob_start_len < 0 and seq.req.lora is None and seq.req.routed_experts_start < 0:
                hits[row] = cache.lookup(tokens[row])
    for seq, hit in zip(fresh, hits, strict=True):
        if hit is not None:
            seq.cached_tokens = max(seq.cached_tokens, min(hit.length, len(seq.req.input_ids)))
    found = [h for h in hits if h is not None]
    if not found:
        ids, mask = left_pad(tokens, pad_id, device)
        return PrefillInputs(ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), None)
    width = max(h.length for h in found)
    cached = [h.length if h is not None else 0 for h in hits]
    ids, suffix_mask = left_pad([t[n:] for t, n in zip(tokens, cached, strict=True)], pad_id, device)
    prefix_mask = torch.zeros((len(fresh), width), dtype=torch.long)
    for row, n in enumerate(cached):
        prefix_mask[row, width - n :] = 1
    mask = torch.cat([prefix_mask.to(device), suffix_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, width:]
    past = []
    for layer in range(len(found[0].kv)):
        keys, values = [], []
        template = found[0].kv[layer][0]
        for hit in hits:
            k, v = hit.kv[layer] if hit is not None else (template[:, :, :0], template[:, :, :0])
            keys.append(_left_pad_kv(k, width))
            values.append(_left_pad_kv(v, width))
        past.append((torch.cat(keys), torch.cat(values)))
    return PrefillInputs(ids, mask, positions, past)


def close_holes(batch: KVBatch) -> KVBatch:
    """Pack each row's real columns to the right (plain left padding again); a hole-free batch as is."""
    mask = batch.mask.bool()
    counts = mask.sum(dim=1)
    columns = torch.arange(batch.width, device=mask.device).unsqueeze(0)
    if bool((mask == (columns >= (batch.width - counts).unsqueeze(1))).all()):
        return batch.trim_left()  # already plainly left-padded
    width = int(counts.max())
    # Per row, its column indices with the padding first and the real ones last, in their order (stable
    # sort); the last `width` of them: the real columns, right-aligned, after some padding ones (zeroed).
    order = torch.sort(batch.mask, dim=1, stable=True).indices[:, -width:]
    new_mask = (torch.arange(width, device=mask.device).unsqueeze(0) >= (width - counts).unsqueeze(1)).long()
    keep = new_mask.bool()[:, None, :, None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        index = order[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[3])
        return torch.where(keep, t.gather(2, index), torch.zeros((), dtype=t.dtype, device=t.device))

    return KVBatch([(pack(k), pack(v)) for k, v in batch.kv], new_mask)


def store_finished(cache: PrefixCache, seqs: list[Seq], batch: KVBatch) -> None:
    """Store the KV of the rows of `batch` (row i is `seqs[i]`) whose sequences finished with stop or length."""
    if batch.rows != len(seqs):
        return
    for row, seq in enumerate(seqs):
        if (
            seq.finish is None
            or seq.finish.get("type") not in STORED_FINISHES
            or seq.cache_epoch != cache.epoch
            or seq.req.lora is not None
        ):
            continue
        tokens = seq.req.input_ids + seq.output[:-1]  # the last sampled token has no KV yet
        columns = batch.mask[row].nonzero().squeeze(1)
        if columns.numel() != len(tokens):
            log.warning("not caching %s: %d KV columns for %d tokens", seq.req.rid, columns.numel(), len(tokens))
            continue
        if len(tokens) < 2 or cache.covered(tokens) or _row_bytes(batch, len(tokens)) > cache.budget_bytes:
            continue
        cache.insert(
            tokens,
            [
                (k[row : row + 1].index_select(2, columns), v[row : row + 1].index_select(2, columns))
                for k, v in batch.kv
            ],
        )


def _row_bytes(batch: KVBatch, length: int) -> int:
    return sum(
        length * (k[0, :, 0].numel() * k.element_size() + v[0, :, 0].numel() * v.element_size()) for k, v in batch.kv
    )


def _left_pad_kv(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


def describe(cache: PrefixCache | None) -> dict[str, Any]:
    """`server_info`'s `prefix_cache` field (zeros when the cache is off)."""
    if cache is None:
        return {
            "entries": 0,
            "tokens": 0,
            "bytes": 0,
            "budget_bytes": 0,
            "lookups": 0,
            "hits": 0,
            "tokens_reused": 0,
            "evictions": 0,
        }
    return cache.stats()
