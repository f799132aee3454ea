"""Request batching in the engine client (`inference.batch_window_ms`, `pipeline.engine.client.coalesce`) against a
real `hf` server on loopback: completions gathered into SGLang batch requests, each still answered, refused,
cancelled and failed over on its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.client.coalesce import BatchPolicy, batch_body
from pipeline.engine.server.hf.process import ServerHandle, start_hf_server
from pipeline.net.addresses import free_port
from tests.integration.test_engine_client import requests_seen, wait_until

GREEDY = {"temperature": 0.0, "ignore_eos": True}
GATHER = BatchPolicy(window_s=0.2, max_batch=64)
"""A long window, so every call a test starts together lands in one batch whatever the machine's load."""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_hf_server(tiny_model_dir, seed=0)
    yield handle
    handle.stop()


def prompts(count: int) -> list[list[int]]:
    return [[5, 6 + i, 7 + 2 * i] for i in range(count)]


async def test_gathered_completions_equal_one_by_one_and_take_one_request(server: ServerHandle) -> None:
    params = [{**GREEDY, "max_new_tokens": 2 + i % 5} for i in range(12)]
    async with EngineClient([server.url]) as plain:
        alone = [await plain.generate(p, s) for p, s in zip(prompts(12), params, strict=True)]
    before = requests_seen(server)
    async with EngineClient([server.url], batching=GATHER) as client:
        gathered = await asyncio.gather(*(client.generate(p, s) for p, s in zip(prompts(12), params, strict=True)))
    assert requests_seen(server) - before == 1, "twelve completions, one /generate request"
    for one, batched, sp in zip(alone, gathered, params, strict=True):
        assert batched.output_ids == one.output_ids and len(batched.output_ids) == sp["max_new_tokens"]
        assert batched.output_logprobs == pytest.approx(one.output_logprobs, abs=1e-5)
        assert batched.finish_reason == one.finish_reason == "length"


async def test_a_refused_completion_fails_alone(server: ServerHandle) -> None:
    bad = [5, 10**6]  # a token id past the vocabulary: the server refuses the whole batch with a 400
    async with EngineClient([server.url], batching=GATHER) as client:
        results = await asyncio.gather(*(client.generate(p, {**GREEDY, "max_new_tokens": 3}) for p in prompts(4)),
                                       client.generate(bad, GREEDY), return_exceptions=True)  # fmt: skip
    *good, refused = results
    assert all(not isinstance(r, BaseException) and len(r.output_ids) == 3 for r in good), good
    assert isinstance(refused, EngineError) and refused.status == 400, refused


async def test_a_cancelled_completion_is_dropped_or_aborted_alone(server: ServerHandle) -> None:
    long = {**GREEDY, "max_new_tokens": 1500}
    async with EngineClient([server.url], batching=GATHER) as client:
        # Cancelled while still gathered: it is never sent.
        before = requests_seen(server)
        early = asyncio.create_task(client.generate([5, 6], long))
        await asyncio.sleep(0.01)
        early.cancel()
        short = await client.generate([5, 7], {**GREEDY, "max_new_tokens": 2})
        assert len(short.output_ids) == 2 and requests_seen(server) - before == 1
        assert early.cancelled()
        # Cancelled once sent with others: only its own rid is aborted; the batch's other completions finish
        # (their batch is answered once the aborted one has ended too, well before its 1500 tokens).
        load = server.server.scheduler.load
        runaway = asyncio.create_task(client.generate([5, 8], long))
        others = [asyncio.create_task(client.generate(p, {**GREEDY, "max_new_tokens": 40})) for p in prompts(3)]
        await wait_until(lambda: requests_seen(server) - before == 2 and load()["running"] >= 1)
        runaway.cancel()
        done = await asyncio.wait_for(asyncio.gather(*others), 60)
        assert [len(r.output_ids) for r in done] == [40, 40, 40]
        assert runaway.cancelled()
        await wait_until(lambda: load()["running"] == 0, timeout=5)


async def test_a_connection_failure_reaches_every_caller_and_each_fails_over(server: ServerHandle) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with EngineClient([dead], batching=GATHER, health_interval_s=0) as client:
        results = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts(3)), return_exceptions=True)
        assert all(isinstance(r, EngineError) and "every inference server failed" in str(r) for r in results)
    async with EngineClient([dead, server.url], batching=GATHER, health_interval_s=0) as client:
        results = await asyncio.gather(*(client.generate(p, {**GREEDY, "max_new_tokens": 2}) for p in prompts(3)))
        assert {r.server for r in results} == {server.url}


def test_batch_body_lists_every_per_prompt_field_in_order() -> None:
    bodies = [{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "stream": False,
               "rid": "a"},
              {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
               "stream": False, "rid": "b", "top_logprobs_num": 3, "lora_path": "arl-lora-v2"}]  # fmt: skip
    assert batch_body(bodies) == {
        "return_logprob": True, "stream": False, "input_ids": [[1], [2, 3]],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}], "rid": ["a", "b"],
        "top_logprobs_num": [0, 3], "lora_path": [None, "arl-lora-v2"],
    }  # fmt: skip
    assert "lora_path" not in batch_body(bodies[:1]) and "top_logprobs_num" not in batch_body(bodies[:1])
