"""The `hf` engine server over real HTTP: logprob correctness, batching, streaming, stops, aborts, bad input."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.engine.server.hf.process import ServerHandle, start_hf_server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_hf_server(tiny_model_dir, max_batch_size=16, seed=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def teacher_forced(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """Log-probabilities of `output` given `prompt` from one unbatched forward pass (the reference)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    if temperature > 1e-6:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def post(server: ServerHandle, body: dict[str, Any], path: str = "/generate") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def lp_values(data: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in data["meta_info"]["output_token_logprobs"]]


def assert_close(got: list[float], want: list[float], tol: float = 1e-4) -> None:
    assert len(got) == len(want)
    worst = max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
    assert worst < tol, f"logprobs differ by {worst}"


async def test_concurrent_requests_of_different_lengths_match_teacher_forcing(server: ServerHandle, reference: Any):
    prompts = [[5 + i] * (3 + 7 * i) + [40 + i, 41, 42] for i in range(6)]  # 6 .. 41 tokens

    async def one(client: httpx.AsyncClient, prompt: list[int], index: int) -> dict[str, Any]:
        await asyncio.sleep(0.01 * index)  # staggered: later requests join a running batch
        sampling = {"max_new_tokens": 6 + 5 * index, "temperature": 1.0, "ignore_eos": True}
        resp = await client.post(
            server.url + "/generate", json={"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        )
        assert resp.status_code == 200, resp.text
        return resp.json()

    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(one(client, p, i) for i, p in enumerate(prompts)))
    for index, (prompt, data) in enumerate(zip(prompts, results, strict=True)):
        assert len(data["output_ids"]) == 6 + 5 * index
        assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 6 + 5 * index}
        assert data["meta_info"]["prompt_tokens"] == len(prompt)
        assert_close(lp_values(data), teacher_forced(reference, prompt, data["output_ids"]))


async def test_long_completions_outgrow_the_kv_buffers_and_match_teacher_forcing(server: ServerHandle, reference: Any):
    """Completions longer than the batch's spare KV columns (`kvbatch.SPARE_COLUMNS`), joining and leaving
    a running batch at different steps, so the buffers are moved to bigger ones mid-generation."""
    from pipeline.engine.server.hf.kvbatch import SPARE_COLUMNS

    lengths = [SPARE_COLUMNS * 2 + 7 * i for i in range(4)]

    async def one(client: httpx.AsyncClient, index: int) -> tuple[list[int], dict[str, Any]]:
        await asyncio.sleep(0.05 * index)
        prompt = [7 + index] * (2 + 9 * index) + [60, 61]
        sampling = {"max_new_tokens": lengths[index], "temperature": 1.0, "ignore_eos": True}
        resp = await client.post(
            server.url + "/generate", json={"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        )
        assert resp.status_code == 200, resp.text
        return prompt, resp.json()

    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(len(lengths))))
    for (prompt, data), length in zip(results, lengths, strict=True):
        assert len(data["output_ids"]) == length
        assert_close(lp_values(data), teacher_forced(reference, prompt, data["output_ids"]))


async def test_a_request_that_is_not_streamed_gets_one_event_holding_every_token(server: ServerHandle):
    from pipeline.engine.server.requests import WorkItem
    from schemas.engine_api import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    whole = [e async for e in server.server.generate(WorkItem("one-event", [5, 6, 7], params, 12, True), stream=False)]
    assert len(whole) == 1 and len(whole[0].new_ids) == 12 and len(whole[0].new_logprobs) == 12
    assert whole[0].finish == {"type": "length", "length": 12}
    streamed = [e async for e in server.server.generate(WorkItem("per-step", [5, 6, 7], params, 12, True), stream=True)]
    assert [len(e.new_ids) for e in streamed] == [1] * 12 and streamed[-1].finish is not None


def test_batched_input_ids_answer_a_list_in_order(server: ServerHandle, reference: Any):
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "ignore_eos": True},
        "return_logprob": True,
        "rid": ["a", "b", "c"],
    }
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    results = resp.json()
    assert [r["meta_info"]["id"] for r in results] == ["a", "b", "c"]
    for prompt, data in zip(prompts, results, strict=True):
        assert_close(lp_values(data), teacher_forced(reference, prompt, data["output_ids"], temperature=0.7))


def test_greedy_is_argmax_with_unscaled_logprobs(server: ServerHandle, reference: Any):
    prompt = [30, 31, 32, 33]
    data = post(
        server,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    ).json()
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + data["output_ids"]])).logits[0]
    argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert data["output_ids"] == argmax
    assert_close(lp_values(data), teacher_forced(reference, prompt, data["output_ids"]))


def test_temperature_scales_returned_logprobs_like_sglang(server: ServerHandle, reference: Any):
    """SGLang's default: logprobs of softmax(logits / T), not of the unscaled distribution."""
    prompt = [50, 51, 52]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 2.5, "ignore_eos": True},
        "return_logprob": True,
    }
    data = post(server, body).json()
    scaled = teacher_forced(reference, prompt, data["output_ids"], temperature=2.5)
    unscaled = teacher_forced(reference, prompt, data["output_ids"])
    assert_close(lp_values(data), scaled)
    assert max(abs(a - b) for a, b in zip(lp_values(data), unscaled, strict=True)) > 1e-2


def test_original_logprob_mode_returns_unscaled(tiny_model_dir: Path, reference: Any):
    with start_hf_server(tiny_model_dir, return_original_logprob=True, seed=1) as other:
        body = {
            "input_ids": [50, 51, 52],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 2.5, "ignore_eos": True},
        }
        data = post(other, body).json()
    assert_close(lp_values(data), teacher_forced(reference, [50, 51, 52], data["output_ids"]))


def test_stream_is_sglang_sse_with_cumulative_chunks(server: ServerHandle, reference: Any):
    prompt = [60, 61, 62, 63, 64]
    body = {
        "input_ids": prompt,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True},
    }
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[6:]))
    assert len(chunks) == 7  # one per token
    for i, chunk in enumerate(chunks):  # cumulative, as SGLang streams by default
        assert len(chunk["output_ids"]) == i + 1 == chunk["meta_info"]["completion_tokens"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert_close(lp_values(final), teacher_forced(reference, prompt, final["output_ids"]))


def test_stop_token_ids_and_eos(server: ServerHandle):
    greedy = post(
        server, {"input_ids": [70, 71], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    ).json()
    stop_at = greedy["output_ids"][2]
    first = greedy["output_ids"].index(stop_at)
    data = post(
        server,
        {
            "input_ids": [70, 71],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]},
        },
    ).json()
    assert data["output_ids"] == greedy["output_ids"][: first + 1]  # the stop token is part of the output
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_ends_generation_and_is_trimmed_from_text(server: ServerHandle, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    greedy = post(
        server, {"input_ids": [80, 81], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    ).json()
    text = tokenizer.decode(greedy["output_ids"][:4], skip_special_tokens=True)
    stop = text[-1]  # a character the greedy completion certainly produces
    data = post(
        server,
        {
            "input_ids": [80, 81],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]},
        },
    ).json()
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in data["text"]
    assert len(data["output_ids"]) <= 4


def test_n_samples_and_seeded_sampling(server: ServerHandle):
    body = {
        "input_ids": [90, 91],
        "sampling_params": {"max_new_tokens": 6, "n": 3, "ignore_eos": True, "sampling_seed": 7},
        "rid": "multi",
    }
    first = post(server, body).json()
    again = post(server, {**body, "rid": "multi2"}).json()
    assert [r["meta_info"]["id"] for r in first] == ["multi_0", "multi_1", "multi_2"]
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]


def test_max_new_tokens_zero_and_context_clipping(server: ServerHandle):
    data = post(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 0}}).json()
    assert data["output_ids"] == [] and data["meta_info"]["finish_reason"]["type"] == "length"
    max_context = httpx.get(server.url + "/model_info").json()["max_context"]
    long_prompt = [5] * (max_context - 3)
    data = post(
        server, {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
    ).json()
    assert len(data["output_ids"]) == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "input_ids"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": "hello"}, "input_ids"),
        ({"input_ids": [1, 2, 99999]}, "outside the vocabulary"),
        ({"input_ids": [1, -4]}, "outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "2 prompts"),
        ({"input_ids": [[1], [2]], "stream": True}, "stream"),
        ({"input_ids": [1], "return_logprob": "maybe"}, "return_logprob"),
        ({"input_ids": [1], "unknown_field": True}, "unknown_field"),
    ],
)
def test_bad_generate_requests_get_400_with_a_reason(server: ServerHandle, body: dict[str, Any], needle: str):
    resp = post(server, body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_prompt_longer_than_context_is_refused(server: ServerHandle):
    max_context = httpx.get(server.url + "/model_info").json()["max_context"]
    resp = post(server, {"input_ids": [5] * max_context})
    assert resp.status_code == 400
    assert "context" in resp.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"", b'{"input_ids": [1]'])
def test_malformed_bodies_get_400(server: ServerHandle, raw: bytes):
    resp = httpx.post(server.url + "/generate", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/update_weights_from_disk", {}),
        ("/update_weights_from_disk", {"model_path": "/definitely/not/here"}),
        ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "v2"}),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2},
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
        ),
        ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
        ("/update_weights_from_distributed", {"names": ["x"], "dtypes": [], "shapes": [[1]]}),
        ("/abort_request", {}),
        ("/pause_generation", {"mode": "sideways"}),
        ("/begin_weight_update", {"selector": "everything"}),
        ("/end_weight_update", {"unknown": 1}),
    ],
)
def test_bad_admin_requests_get_400_success_false(server: ServerHandle, path: str, body: dict[str, Any]):
    resp = post(server, body, path)
    assert resp.status_code == 400, resp.text
    assert resp.json()["success"] is False and resp.json()["message"]


def test_info_and_health_endpoints(server: ServerHandle, tiny_model_dir: Path):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.url + "/model_info").json()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert httpx.get(server.url + "/server_info").json()["tp_size"] == 1
    # SGLang's deprecated names answer the same; SGLang has no /get_weight_version (the version is in /model_info)
    assert httpx.get(server.url + "/get_model_info").json() == info
    assert httpx.get(server.url + "/get_server_info").json()["tp_size"] == 1
    assert httpx.get(server.url + "/get_weight_version").status_code == 404
    assert httpx.post(server.url + "/flush_cache").status_code == 200


async def test_abort_request_finishes_a_running_generation(server: ServerHandle):
    async with httpx.AsyncClient(timeout=60) as client:
        long = asyncio.create_task(
            client.post(
                server.url + "/generate",
                json={
                    "input_ids": [5, 6],
                    "rid": "to-abort",
                    "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True},
                },
            )
        )
        await _wait_running(server, 1)
        resp = await client.post(server.url + "/abort_request", json={"rid": "to-abort"})
        assert resp.status_code == 200
        data = (await long).json()
    assert data["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(data["output_ids"]) < 1900


async def test_pause_in_place_holds_requests_until_continue(server: ServerHandle, reference: Any):
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await client.post(server.url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
        task = asyncio.create_task(
            client.post(
                server.url + "/generate",
                json={
                    "input_ids": [9, 9, 9],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                },
            )
        )
        await asyncio.sleep(0.3)
        assert not task.done()  # held while paused
        assert (await client.post(server.url + "/continue_generation")).status_code == 200
        data = (await task).json()
    assert_close(lp_values(data), teacher_forced(reference, [9, 9, 9], data["output_ids"]))


async def test_disconnected_client_frees_its_batch_slot(server: ServerHandle):
    async with httpx.AsyncClient(timeout=60) as client:
        task = asyncio.create_task(
            client.post(
                server.url + "/generate",
                json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}},
            )
        )
        await _wait_running(server, 1)
        task.cancel()
    await _wait_running(server, 0)


async def _wait_running(server: ServerHandle, count: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while server.server.scheduler.load()["running"] != count:
        assert loop.time() < deadline, f"running never became {count}: {server.server.scheduler.load()}"
        await asyncio.sleep(0.01)


def test_logprobs_are_finite(server: ServerHandle):
    data = post(
        server,
        {
            "input_ids": [3, 4],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "top_k": 3, "top_p": 0.5, "min_p": 0.1},
        },
    ).json()
    assert all(math.isfinite(v) and v <= 0 for v in lp_values(data))


@pytest.mark.slow
def test_fuzzed_generate_bodies_never_get_a_5xx(server: ServerHandle):
    """Random (mostly wrong) bodies: every answer is a 200 or a 4xx with a message, and the server stays up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=5)
    )
    token_lists = st.lists(st.integers(-5, 700), max_size=6)
    sampling = st.dictionaries(
        st.sampled_from(
            [
                "max_new_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "n",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "bogus",
                "repetition_penalty",
            ]
        ),
        st.one_of(scalar, token_lists, st.integers(0, 3)),
        max_size=4,
    )
    body = st.fixed_dictionaries(
        {},
        optional={
            "input_ids": st.one_of(scalar, token_lists, st.lists(token_lists, max_size=3)),
            "text": st.one_of(scalar, st.text(max_size=10)),
            "sampling_params": st.one_of(scalar, sampling),
            "return_logprob": scalar,
            "stream": st.booleans(),
            "rid": scalar,
        },
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body)
    def check(payload: dict[str, Any]) -> None:
        sp = payload.get("sampling_params")
        if isinstance(sp, dict) and isinstance(sp.get("max_new_tokens"), int):
            sp["max_new_tokens"] = min(sp["max_new_tokens"], 4)  # keep the accepted ones short
        elif isinstance(sp, dict) or sp is None:
            payload["sampling_params"] = {**(sp or {}), "max_new_tokens": 2}
        # json.dumps, not httpx's encoder: NaN/Infinity must reach the server (as Python's JSON writes them).
        raw = json.dumps(payload)
        resp = httpx.post(server.url + "/generate", content=raw, headers={"Content-Type": "application/json"},
                          timeout=60)  # fmt: skip
        assert resp.status_code in (200, 400), (payload, resp.status_code, resp.text)
        if resp.status_code == 400:
            assert resp.json()["error"]["message"]

    check()
    assert httpx.get(server.url + "/health").status_code == 200
