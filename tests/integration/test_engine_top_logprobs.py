"""`top_logprobs_num` on a real `hf` server (and through the engine client): SGLang's
`meta_info.output_top_logprobs` equals the top-k of a teacher-forced forward pass, in batches, streams
and `n` > 1, and follows the server's logprob mode (temperature-scaled, or unscaled when opted in)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.engine.client import EngineClient
from pipeline.engine.server.hf.process import ServerHandle, start_hf_server

TOL = 1e-4  # fp32 on CPU; measured differences are ~1e-6


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    # These tests compare repeated identical requests bit for bit; a prefix-cache hit computes the same values
    # with other rounding (~1e-7), so reuse is off here (tests/integration/test_prefix_cache.py covers it).
    with start_hf_server(tiny_model_dir, max_batch_size=16, seed=0, prefix_cache_mb=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def forced_top(model: Any, prompt: list[int], output: list[int], k: int, temperature: float) -> list[Any]:
    """Per output position, the top-k (values, ids) of one unbatched teacher-forced forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    if temperature > 1e-6:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return [logprobs[i].topk(k) for i in range(len(output))]


def assert_top_matches(data: dict[str, Any], model: Any, prompt: list[int], k: int, temperature: float) -> None:
    tops = data["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(data["output_ids"])
    for got, want in zip(tops, forced_top(model, prompt, data["output_ids"], k, temperature), strict=True):
        assert len(got) == k and all(text is None for _, _, text in got)
        assert [tok for _, tok, _ in got] == want.indices.tolist()
        assert max(abs(lp - w) for (lp, _, _), w in zip(got, want.values.tolist(), strict=True)) < TOL
        assert [lp for lp, _, _ in got] == sorted((lp for lp, _, _ in got), reverse=True)
    for (lp, tok, _), top in zip(data["meta_info"]["output_token_logprobs"], tops, strict=True):
        listed = {t: v for v, t, _ in top}
        if tok in listed:  # the sampled token, when among the k most likely, carries its own logprob
            assert abs(listed[tok] - lp) < 1e-6


def post(server: ServerHandle, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=60)


def test_greedy_top_one_is_the_generated_token(server: ServerHandle, reference: Any) -> None:
    prompt = [30, 31, 32, 33]
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 4,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    data = post(server, body).json()
    tops = data["meta_info"]["output_top_logprobs"]
    assert [top[0][1] for top in tops] == data["output_ids"]
    assert [top[0][0] for top in tops] == [lp for lp, _, _ in data["meta_info"]["output_token_logprobs"]]
    assert_top_matches(data, reference, prompt, 4, 0.0)


async def test_concurrent_sampled_requests_match_teacher_forced_top_k(server: ServerHandle, reference: Any) -> None:
    """Different k (0 included), prompt lengths and temperatures in one continuous batch."""
    cases = [([5 + i] * (2 + 5 * i) + [40, 41], k, t) for i, (k, t) in enumerate([(3, 0.7), (0, 1.0), (20, 1.3),
                                                                                   (1, 1.0), (5, 0.0)])]  # fmt: skip

    async def one(client: httpx.AsyncClient, prompt: list[int], k: int, temperature: float) -> dict[str, Any]:
        body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": k,
                "sampling_params": {"max_new_tokens": 9, "temperature": temperature, "ignore_eos": True}}  # fmt: skip
        resp = await client.post(server.url + "/generate", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(one(client, *case) for case in cases))
    for (prompt, k, temperature), data in zip(cases, results, strict=True):
        if k == 0:
            assert "output_top_logprobs" not in data["meta_info"]  # not asked: not computed, not sent
        else:
            assert_top_matches(data, reference, prompt, k, temperature)


def test_batch_with_n_samples_and_text(server: ServerHandle, reference: Any) -> None:
    body = {"input_ids": [[7, 8, 9], [20, 21]], "return_logprob": True, "top_logprobs_num": [2, 3],
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "n": 2, "temperature": 0.9, "ignore_eos": True}}  # fmt: skip
    results = post(server, body).json()
    assert len(results) == 4
    for data, prompt, k in zip(results, [[7, 8, 9]] * 2 + [[20, 21]] * 2, [2, 2, 3, 3], strict=True):
        tops = data["meta_info"]["output_top_logprobs"]
        want = forced_top(reference, prompt, data["output_ids"], k, 0.9)
        for got, ref in zip(tops, want, strict=True):
            assert [tok for _, tok, _ in got] == ref.indices.tolist()
            assert all(isinstance(text, str) for _, _, text in got)  # return_text_in_logprobs


def test_stream_equals_non_stream(server: ServerHandle) -> None:
    sampling = {"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
    body = {"input_ids": [60, 61, 62], "return_logprob": True, "top_logprobs_num": 5, "sampling_params": sampling}
    whole = post(server, body).json()
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(chunks) == 7
    for i, chunk in enumerate(chunks):  # cumulative, like output_token_logprobs
        assert len(chunk["meta_info"]["output_top_logprobs"]) == i + 1
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["output_top_logprobs"] == whole["meta_info"]["output_top_logprobs"]


async def test_engine_client_passes_top_logprobs_through(server: ServerHandle) -> None:
    params = {"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 3}
    async with EngineClient([server.url], health_interval_s=0) as client:
        whole = await client.generate([11, 12, 13], params, top_logprobs_num=3)
        chunks = [c async for c in client.generate_stream([11, 12, 13], params, top_logprobs_num=3)]
        plain = await client.generate([11, 12, 13], params)
    assert whole.output_top_logprobs is not None and len(whole.output_top_logprobs) == 6
    assert all(len(top) == 3 for top in whole.output_top_logprobs)
    assert [top for c in chunks for top in c.new_top_logprobs or []] == whole.output_top_logprobs
    assert plain.output_ids == whole.output_ids and plain.output_top_logprobs is None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"top_logprobs_num": 21}, "between 0 and 20"),
        ({"top_logprobs_num": -1}, "between 0 and 20"),
        ({"top_logprobs_num": "three"}, "top_logprobs_num"),
        ({"top_logprobs_num": [2, 2]}, "top_logprobs_num has 2 entries"),
        ({"top_logprobs_num": 2, "return_logprob": False}, "needs return_logprob"),
    ],
)
def test_bad_top_logprobs_num_is_a_400(server: ServerHandle, extra: dict[str, Any], needle: str) -> None:
    resp = post(server, {"input_ids": [1, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 1},
                         **extra})  # fmt: skip
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_original_logprob_mode_and_incremental_stream(tiny_model_dir: Path, reference: Any) -> None:
    """Unscaled top logprobs when the server opts into original logprobs; deltas when streaming incrementally."""
    prompt = [50, 51, 52]
    sampling = {"max_new_tokens": 6, "temperature": 2.5, "ignore_eos": True, "sampling_seed": 5}
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 4, "sampling_params": sampling}
    with start_hf_server(tiny_model_dir, return_original_logprob=True, incremental_streaming_output=True,
                         prefix_cache_mb=0) as other:  # fmt: skip
        whole = post(other, body).json()
        with httpx.stream("POST", other.url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert_top_matches(whole, reference, prompt, 4, 0.0)  # unscaled, whatever the temperature
    assert [len(c["meta_info"]["output_top_logprobs"]) for c in chunks] == [1] * 6  # one delta per token
    assert [t for c in chunks for t in c["meta_info"]["output_top_logprobs"]] == whole["meta_info"][
        "output_top_logprobs"
    ]
