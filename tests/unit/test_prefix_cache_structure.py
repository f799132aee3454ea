"""The prefix cache's structure: longest-prefix lookup, subsumption, LRU eviction under a byte budget,
clearing; and the tensor plumbing of a prefill from hits (mask, positions, hole closing)."""

from __future__ import annotations

import asyncio
import random

import torch

from pipeline.engine.server.hf.kvbatch import KVBatch
from pipeline.engine.server.hf.prefix_cache import PrefixCache, close_holes, kv_bytes, prefill_inputs
from pipeline.engine.server.hf.sampling import RowSampling
from pipeline.engine.server.hf.sequences import GenRequest, Seq

LAYERS, HEADS, DIM = 2, 2, 4
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # fp32 keys and values of one token


def kv_for(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every element is the token id (and the layer), so slices can be checked."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, HEADS, len(tokens), DIM)
    return [(base + layer, -(base + layer)) for layer in range(LAYERS)]


def test_lookup_finds_the_longest_prefix_and_leaves_one_token() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 9, 9], kv_for([1, 2, 9, 9]))
    hit = cache.lookup([1, 2, 3, 4, 5, 6, 7])
    assert hit is not None and hit.length == 5
    assert hit.kv[1][0][0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]  # layer 1 = token + 1
    partial = cache.lookup([1, 2, 3, 7])
    assert partial is not None and partial.length == 3  # part of an entry is usable
    whole = cache.lookup([1, 2, 3, 4, 5])  # the prompt is all cached: its last token is still computed
    assert whole is not None and whole.length == 4
    assert cache.lookup([8, 1, 2]) is None and cache.lookup([1]) is None
    assert (cache.lookups, cache.hits, cache.tokens_reused) == (5, 3, 12)


def test_an_extension_replaces_its_prefix_and_a_prefix_adds_nothing() -> None:
    cache = PrefixCache(1 << 20)
    assert cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    assert cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    assert len(cache) == 1 and cache.nbytes == 5 * TOKEN_BYTES
    assert not cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))  # covered by the entry
    assert cache.covered([1, 2, 3, 4]) and not cache.covered([1, 2, 3, 4, 5, 6])
    assert cache.insert([1, 2, 7], kv_for([1, 2, 7]))  # a branch: its own entry
    assert len(cache) == 2 and cache.nbytes == 8 * TOKEN_BYTES


def test_lookups_and_inserts_agree_with_comparing_every_entry() -> None:
    """The sorted index (neighbours, walk-down for extended entries) against the plain definition: many
    random branching sequences over 3 token ids, so entries share prefixes of every length."""
    rng = random.Random(0)
    cache = PrefixCache(1 << 30)
    entries: list[tuple[int, ...]] = []  # the reference: what a scan of every entry would keep

    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for _ in range(600):
        tokens = tuple(rng.randrange(3) for _ in range(rng.randint(1, 9)))
        best = max((min(common(e, tokens), len(tokens) - 1) for e in entries), default=0)
        hit = cache.lookup(tokens)
        assert (hit.length if hit is not None else 0) == best, tokens
        covered = any(e[: len(tokens)] == tokens for e in entries)
        assert cache.covered(tokens) == covered
        if rng.random() < 0.5:
            assert cache.insert(tokens, kv_for(list(tokens))) == (not covered)
            if not covered:
                entries = [e for e in entries if tokens[: len(e)] != e] + [tokens]
        assert len(cache) == len(entries)
    assert cache.nbytes == sum(len(e) for e in entries) * TOKEN_BYTES


def test_least_recently_used_entries_leave_first_and_bytes_stay_within_budget() -> None:
    cache = PrefixCache(10 * TOKEN_BYTES)
    cache.insert([1, 1, 1, 1], kv_for([1, 1, 1, 1]))
    cache.insert([2, 2, 2, 2], kv_for([2, 2, 2, 2]))
    assert cache.lookup([1, 1, 1, 1, 5]) is not None  # entry 1 is now the most recently used
    cache.insert([3, 3, 3, 3], kv_for([3, 3, 3, 3]))  # 12 tokens > 10: entry 2 leaves
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 2 and cache.evictions == 1
    assert cache.lookup([2, 2, 2, 2, 5]) is None
    assert cache.lookup([1, 1, 1, 1, 5]) is not None and cache.lookup([3, 3, 3, 3, 5]) is not None
    too_big = list(range(11))
    assert not cache.insert(too_big, kv_for(too_big)) and len(cache) == 2


def test_clear_drops_everything_and_starts_a_new_epoch() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    epoch = cache.epoch
    assert cache.clear() == (1, 3 * TOKEN_BYTES)
    assert len(cache) == 0 and cache.nbytes == 0 and cache.epoch == epoch + 1
    assert cache.stats()["entries"] == 0 and kv_bytes(kv_for([1])) == TOKEN_BYTES


def seq(tokens: list[int], logprob_start_len: int = -1) -> Seq:
    request = GenRequest("r", tokens, 4, RowSampling(), set(), [], asyncio.new_event_loop(), asyncio.Queue(),
                         logprob_start_len=logprob_start_len)  # fmt: skip
    request.loop.close()
    return Seq(request)


def test_prefill_inputs_join_hits_and_misses_with_explicit_positions() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([7, 8], kv_for([7, 8]))
    fresh = [seq([1, 2, 3, 4, 5]), seq([7, 8, 9, 10, 11]), seq([20, 21]), seq([1, 2, 3, 4, 6], logprob_start_len=0)]
    inputs = prefill_inputs(cache, fresh, pad_id=0, device=torch.device("cpu"))
    assert [s.cached_tokens for s in fresh] == [4, 2, 0, 0]  # the scored prompt does not use the cache
    assert inputs.ids.tolist() == [[0, 0, 0, 0, 5], [0, 0, 9, 10, 11], [0, 0, 0, 20, 21], [1, 2, 3, 4, 6]]
    assert inputs.mask.tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0, 1],
        [0, 0, 1, 1, 0, 0, 1, 1, 1],  # a hole between the cached part and the rest
        [0, 0, 0, 0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1, 1],
    ]
    assert inputs.positions[:, -1].tolist() == [4, 4, 1, 4]
    assert inputs.positions[1].tolist()[2:] == [2, 3, 4]
    assert inputs.past is not None and inputs.past[0][0].shape == (4, HEADS, 4, DIM)
    assert inputs.past[0][0][1, 0, :, 0].tolist() == [0.0, 0.0, 7.0, 8.0]


def test_close_holes_packs_real_columns_to_the_right() -> None:
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [0, 0, 0, 1]])
    keys = torch.arange(1, 13, dtype=torch.float32).reshape(3, 1, 4, 1)
    batch = close_holes(KVBatch([(keys, -keys)], mask))
    assert batch.mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert batch.kv[0][0][:, 0, :, 0].tolist() == [[1.0, 2.0, 4.0], [6.0, 7.0, 8.0], [0.0, 0.0, 12.0]]
    assert batch.kv[0][1][2, 0, :, 0].tolist() == [0.0, 0.0, -12.0]
    plain = KVBatch([(keys, keys)], torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]))
    trimmed = close_holes(plain)
    assert trimmed.width == 3 and torch.equal(trimmed.kv[0][0], keys[:, :, 1:])
