"""Prefix reuse in the `hf` engine over real HTTP: multi-turn conversations served from cached KV must
give the log-probabilities of a cold teacher-forced pass (fp32, 1e-5), with sessions interleaved,
evictions under a small budget, `/flush_cache`, weight updates (which empty the cache) and scored prompts
(which never use it). One test drives the prefill plumbing directly to pin down batches with holes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.engine.server.hf.process import start_hf_server

TOL = 1e-5


@dataclass
class Turn:
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    cached: int


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as the tiny model, other weights (seed 1)."""
    from pipeline.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_seed1") / "m", template="qwen", seed=1)


def teacher_forced(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probabilities of `output` after `prompt` from one cold forward pass (no cache), temperature 1."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt + output])).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def worst(turn: Turn, model: Any) -> float:
    want = teacher_forced(model, turn.prompt, turn.output)
    assert len(want) == len(turn.logprobs)
    return max(abs(a - b) for a, b in zip(turn.logprobs, want, strict=True))


async def generate(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int) -> Turn:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
    resp = await client.post(url + "/generate", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    logprobs = [entry[0] for entry in data["meta_info"]["output_token_logprobs"]]
    return Turn(prompt, data["output_ids"], logprobs, data["meta_info"]["cached_tokens"])


async def converse(
    client: httpx.AsyncClient, url: str, first: list[int], turns: int, max_new: int, suffix: Callable[[int], list[int]]
) -> list[Turn]:
    """An agent's session: each turn's prompt is the previous prompt + its output + `suffix(turn)`."""
    history: list[Turn] = []
    prompt = first
    for k in range(turns):
        turn = await generate(client, url, prompt, max_new)
        history.append(turn)
        prompt = turn.prompt + turn.output + suffix(k)
    return history


def cache_info(url: str) -> dict[str, int]:
    return dict(httpx.get(url + "/server_info").json()["prefix_cache"])


async def test_interleaved_multiturn_sessions_reuse_their_history_and_match_a_cold_pass(
    tiny_model_dir: Path, reference: Any
):
    with start_hf_server(tiny_model_dir, max_batch_size=16, seed=0) as server:
        async with httpx.AsyncClient(timeout=120) as client:
            sessions = await asyncio.gather(*(
                converse(client, server.url, [3 + s] * (10 + 7 * s), turns=8, max_new=4 + 2 * s,
                         suffix=lambda k, s=s: [40 + k, 41, 50 + s])  # type: ignore[misc]
                for s in range(5)
            ))  # fmt: skip
        info = cache_info(server.url)
    for history in sessions:
        assert history[0].cached == 0
        for before, turn in itertools.pairwise(history):
            # turn k's prompt and output are cached, all but its last sampled token (never fed back)
            assert turn.cached == len(before.prompt) + len(before.output) - 1 > 0
        assert max(worst(turn, reference) for turn in history) < TOL
    assert info["entries"] == 5  # each session's turns subsume the one before
    assert info["hits"] == 5 * 7 and info["evictions"] == 0 and 0 < info["bytes"] <= info["budget_bytes"]


async def test_a_small_budget_evicts_keeps_its_bytes_within_it_and_stays_exact(tiny_model_dir: Path, reference: Any):
    # The tiny model's KV is 1 KiB per token: 1 MiB holds 1024 tokens, less than 8 sessions of ~150 tokens.
    with start_hf_server(tiny_model_dir, max_batch_size=16, seed=1, prefix_cache_mb=1) as server:
        seen: list[dict[str, int]] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                seen.append(await asyncio.to_thread(cache_info, server.url))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(timeout=120) as client:
            sessions = await asyncio.gather(*(
                converse(client, server.url, [100 + s] * 60, turns=8, max_new=8,
                         suffix=lambda k, s=s: [200 + k, 201, 202, 210 + s])  # type: ignore[misc]
                for s in range(8)
            ))  # fmt: skip
        done.set()
        await watcher
        seen.append(cache_info(server.url))
    last = seen[-1]
    assert last["evictions"] > 0 and last["hits"] > 0
    assert all(info["bytes"] <= info["budget_bytes"] == 2**20 for info in seen)
    assert any(turn.cached > 0 for history in sessions for turn in history[1:])
    assert max(worst(turn, reference) for history in sessions for turn in history) < TOL


async def test_flush_cache_empties_the_cache(tiny_model_dir: Path, reference: Any):
    with start_hf_server(tiny_model_dir, seed=2) as server:
        async with httpx.AsyncClient(timeout=60) as client:
            first = await converse(client, server.url, [7] * 30, turns=2, max_new=6, suffix=lambda k: [60 + k, 61])
            assert first[1].cached > 0
            resp = await client.post(server.url + "/flush_cache")
            assert resp.status_code == 200 and "dropped 1 prefix-cache entries" in resp.text
            assert cache_info(server.url)["entries"] == 0 and cache_info(server.url)["bytes"] == 0
            prompt = first[1].prompt + first[1].output + [62]
            after = await generate(client, server.url, prompt, 6)
            again = await generate(client, server.url, prompt + after.output + [63], 6)
    assert after.cached == 0 and again.cached > 0
    assert max(worst(turn, reference) for turn in [*first, after, again]) < TOL


async def test_every_weight_update_empties_the_cache(
    tiny_model_dir: Path, other_model_dir: Path, reference: Any
) -> None:
    new = load(other_model_dir)
    with start_hf_server(tiny_model_dir, seed=3) as server:
        async with httpx.AsyncClient(timeout=60) as client:

            async def update(model_dir: Path, version: int) -> None:
                body = {"model_path": str(model_dir), "weight_version": str(version)}
                resp = await client.post(server.url + "/update_weights_from_disk", json=body)
                assert resp.status_code == 200, resp.text
                assert cache_info(server.url)["entries"] == 0

            turns = await converse(client, server.url, [9] * 25, turns=2, max_new=6, suffix=lambda k: [70 + k])
            await update(other_model_dir, 1)  # KV of the old weights must not serve the new ones
            turns += [await generate(client, server.url, turns[-1].prompt + turns[-1].output + [72], 6)]
            turns += [await generate(client, server.url, turns[-1].prompt + turns[-1].output + [73], 6)]
            await update(tiny_model_dir, 2)  # back to the first weights: a version change all the same
            turns += [await generate(client, server.url, turns[-1].prompt + turns[-1].output + [74], 6)]
    assert [t.cached > 0 for t in turns] == [False, True, False, True, False]
    assert max(worst(t, reference) for t in turns[:2] + turns[4:]) < TOL
    assert max(worst(t, new) for t in turns[2:4]) < TOL


async def test_a_request_paused_in_place_across_an_update_is_not_cached(
    tiny_model_dir: Path, other_model_dir: Path
) -> None:
    """Its KV is partly the old weights': storing it would serve old-weight KV to later requests."""
    with start_hf_server(tiny_model_dir, seed=4) as server:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"input_ids": [5] * 20, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
            long = asyncio.create_task(client.post(server.url + "/generate", json=body))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while server.server.scheduler.load()["running"] != 1:
                assert loop.time() < deadline, "the long request never ran"
                await asyncio.sleep(0.01)
            assert (await client.post(server.url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
            update = {"model_path": str(other_model_dir), "weight_version": "1"}
            assert (await client.post(server.url + "/update_weights_from_disk", json=update)).status_code == 200
            assert (await client.post(server.url + "/continue_generation", json={})).status_code == 200
            data = (await long).json()
            assert data["meta_info"]["finish_reason"]["type"] == "length"
            assert cache_info(server.url)["entries"] == 0
            short = await converse(client, server.url, [6] * 20, turns=2, max_new=4, suffix=lambda k: [80])
            assert cache_info(server.url)["entries"] == 1  # the later session's own
    assert short[1].cached > 0


async def test_scored_prompts_never_use_the_cache(tiny_model_dir: Path, reference: Any):
    with start_hf_server(tiny_model_dir, seed=5) as server:
        async with httpx.AsyncClient(timeout=60) as client:
            turns = await converse(client, server.url, [11] * 30, turns=2, max_new=6, suffix=lambda k: [90])
            prompt = turns[1].prompt + turns[1].output + [91]
            body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
            data = (await client.post(server.url + "/generate", json=body)).json()
    assert turns[1].cached > 0 and data["meta_info"]["cached_tokens"] == 0
    scored = [entry[0] for entry in data["meta_info"]["input_token_logprobs"][1:]]
    want = teacher_forced(reference, prompt[:1], prompt[1:])
    assert max(abs(a - b) for a, b in zip(scored, want, strict=True)) < 1e-4


def test_a_prefill_mixing_hits_of_different_lengths_and_misses_equals_a_cold_pass(reference: Any):
    """Rows with a cached prefix shorter than the widest have a hole in their mask; after the pass the
    holes are closed and the next decode step is exact too."""
    from pipeline.engine.server.hf.kvbatch import KVBatch, cache_tensors, dynamic_cache
    from pipeline.engine.server.hf.prefix_cache import PrefixCache, close_holes, prefill_inputs
    from pipeline.engine.server.hf.sampling import RowSampling
    from pipeline.engine.server.hf.sequences import GenRequest, Seq

    config = reference.config
    cache = PrefixCache(1 << 24)
    long_prefix, short_prefix = list(range(20, 60)), list(range(70, 82))
    with torch.inference_mode():
        for prefix in (long_prefix, short_prefix):
            out = reference(input_ids=torch.tensor([prefix]), past_key_values=dynamic_cache(None, config))
            cache.insert(prefix, [(k.clone(), v.clone()) for k, v in cache_tensors(out.past_key_values)])
        prompts = [
            [*long_prefix, 5, 6, 7],
            short_prefix + list(range(100, 120)),
            [9, 8, 7, 6, 5],
            [*long_prefix[:30], 1],
        ]
        loop = asyncio.new_event_loop()
        fresh = [Seq(GenRequest(f"r{i}", p, 4, RowSampling(), set(), [], loop, asyncio.Queue()))
                 for i, p in enumerate(prompts)]  # fmt: skip
        loop.close()
        inputs = prefill_inputs(cache, fresh, pad_id=0, device=torch.device("cpu"))
        assert [s.cached_tokens for s in fresh] == [40, 12, 0, 30]
        assert bool((inputs.mask[1, :40].sum() == 12) and inputs.mask[1, 40:].sum() == 20)  # a hole at 52..59
        past = dynamic_cache(inputs.past, config)
        out = reference(input_ids=inputs.ids, attention_mask=inputs.mask, position_ids=inputs.positions,
                        past_key_values=past, logits_to_keep=1)  # fmt: skip
        batch = close_holes(KVBatch(cache_tensors(out.past_key_values), inputs.mask))
        assert batch.width == max(len(p) for p in prompts)
        nxt = torch.tensor([[3], [4], [5], [6]])
        mask = torch.cat([batch.mask, batch.mask.new_ones(batch.rows, 1)], dim=1)
        step = reference(input_ids=nxt, attention_mask=mask, position_ids=batch.lengths(),
                         past_key_values=dynamic_cache(batch.kv, config), use_cache=True)  # fmt: skip
        for row, prompt in enumerate(prompts):
            cold = reference(input_ids=torch.tensor([[*prompt, int(nxt[row, 0])]])).logits[0].float()
            assert (out.logits[row, -1].float() - cold[-2]).abs().max().item() < TOL
            assert (step.logits[row, -1].float() - cold[-1]).abs().max().item() < TOL
