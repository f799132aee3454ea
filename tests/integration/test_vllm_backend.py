"""The `vllm` backend against a real CPU vLLM server (in `.vllm-venv`) through our SGLang-protocol adapter.

Skipped with a reason when `.vllm-venv` is absent (build it with scripts/vllm_venv.sh; CI does).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from vllm_process import VLLMServer, serving  # tests/integration is on sys.path (pytest)

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.inference.procs import vllm_venv_python
from pipeline.engine.weight_group import broadcast_from_trainer, destroy_weight_group, dtype_name, init_weight_group
from pipeline.net.addresses import free_port

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_venv_python() is None, reason="no .vllm-venv: build it with scripts/vllm_venv.sh"),
]
TOL = 2e-3  # vLLM's CPU kernels (fused qkv, its own attention) vs transformers' eager path, fp32
# Input logprobs served in fp32 vs a transformers fp32 forward: measured up to 9.5e-7 (4 seeds, 32- and
# 200-token probes: the same weights through oneDNN's GEMMs and vLLM's CPU attention instead of torch's
# eager ops). 1e-5 leaves 10x room; a wrong weight moves them by tenths (pipeline/trainer/publish/verify.py).
PROMPT_TOL = 1e-5


@pytest.fixture(scope="module")
def vllm_url(shared_vllm: VLLMServer, tiny_model_dir: Path) -> str:
    """The server shared with test_vllm_interrupt (conftest.py), serving the tiny model as version 0."""
    return serving(shared_vllm, tiny_model_dir).url


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def teacher_forced(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL


PROMPT = [11, 12, 13, 14, 15]


async def test_generate_token_in_token_out_with_scaled_logprobs(vllm_url: str, tiny_model_dir: Path):
    model = load(tiny_model_dir)
    async with EngineClient([vllm_url]) as client:
        results = await asyncio.gather(
            *(
                client.generate(PROMPT[: 2 + i], {"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True})
                for i in range(4)
            )
        )
    for i, result in enumerate(results):
        assert len(result.output_ids) == 8 and result.finish_reason == "length" and result.weight_version == 0
        assert close(result.output_logprobs, teacher_forced(model, PROMPT[: 2 + i], result.output_ids, 0.8))


async def test_top_logprobs_are_vllms_top_k_in_sglang_shape(vllm_url: str, tiny_model_dir: Path):
    """`top_logprobs_num` becomes vLLM's `logprobs: k`; with top-k/top-p off, its processed logprobs are the
    temperature-scaled distribution, so the alternatives equal a teacher-forced top-k (stream and not)."""
    model = load(tiny_model_dir)
    params = {"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 4}
    async with EngineClient([vllm_url]) as client:
        whole = await client.generate(PROMPT, params, top_logprobs_num=3)
        chunks = [c async for c in client.generate_stream(PROMPT, params, top_logprobs_num=3)]
    assert whole.output_top_logprobs is not None and len(whole.output_top_logprobs) == 6
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + whole.output_ids])).logits[0].float() / 0.8
    want = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : -1].topk(3)
    for got, values, ids in zip(whole.output_top_logprobs, want.values.tolist(), want.indices.tolist(), strict=True):
        assert [t for _, t in got] == ids and close([v for v, _ in got], values)
    assert [t for c in chunks for t in c.new_ids] == whole.output_ids  # seeded: the same sample
    streamed = [top for c in chunks for top in c.new_top_logprobs or []]
    assert [[t for _, t in top] for top in streamed] == [[t for _, t in top] for top in whole.output_top_logprobs]


async def test_stream_and_stop_tokens(vllm_url: str):
    async with EngineClient([vllm_url]) as client:
        greedy = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        chunks = [
            c async for c in client.generate_stream(PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        ]
        stop_at = greedy.output_ids[2]
        stopped = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]})
    assert [t for c in chunks for t in c.new_ids] == greedy.output_ids
    assert chunks[-1].finish_reason == "length"
    assert stopped.output_ids == greedy.output_ids[: greedy.output_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.matched == stop_at


def test_bad_input_is_a_400(vllm_url: str):
    resp = httpx.post(vllm_url + "/generate", json={"input_ids": [1, 99999]})
    assert resp.status_code == 400 and "vocabulary" in resp.json()["error"]["message"]
    resp = httpx.post(vllm_url + "/generate", json={"input_ids": [1], "sampling_params": {"n": 0}})
    assert resp.status_code == 400


PROBE = [(7 * i + 3) % 500 for i in range(32)]


async def test_input_logprobs_equal_a_transformers_forward(vllm_url: str, tmp_path: Path):
    """SGLang's `input_token_logprobs` from vLLM's prompt logprobs: raw (no temperature), first scored
    position null, from `logprob_start_len` on; top logprobs, streaming and scoring-only alike."""
    from pipeline.demo.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "seed4", seed=4)  # swapped in first: what is scored is what serves now
    async with EngineClient([vllm_url]) as client:
        await client.update_weights_from_disk(str(other), weight_version=4)
    with torch.no_grad():
        want = torch.log_softmax(load(other)(input_ids=torch.tensor([PROBE])).logits[0].float(), dim=-1)
    body = {"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}  # fmt: skip
    async with httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
        whole = (await http.post("/generate", json=body)).json()
        later = {**body, "logprob_start_len": 20, "top_logprobs_num": 3,
                 "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}}  # fmt: skip
        scored = (await http.post("/generate", json=later)).json()
        async with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            events = [json.loads(line[5:]) for line in [ln async for ln in resp.aiter_lines()]
                      if line.startswith("data:") and "[DONE]" not in line]  # fmt: skip
    entries = whole["meta_info"]["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == PROBE and entries[0][0] is None
    gaps = [abs(lp - want[i - 1, tok].item()) for i, (lp, tok, _) in enumerate(entries) if i > 0]
    assert max(gaps) < PROMPT_TOL, max(gaps)
    assert len(whole["output_ids"]) == 1 and whole["meta_info"]["weight_version"] == "4"
    assert events[-1]["meta_info"]["input_token_logprobs"] == entries
    # From position 20, scoring only: 12 entries, the first null; top logprobs unscaled by the temperature.
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    assert [tok for _, tok, _ in meta["input_token_logprobs"]] == PROBE[20:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for i, (lp, tok, _) in enumerate(meta["input_token_logprobs"][1:], start=21):
        assert abs(lp - want[i - 1, tok].item()) < PROMPT_TOL
        values, ids = want[i - 1].topk(3)
        top = meta["input_top_logprobs"][i - 20]
        assert [t for _, t, _ in top] == ids.tolist()
        assert max(abs(v - w) for (v, _, _), w in zip(top, values.tolist(), strict=True)) < PROMPT_TOL


async def test_weights_by_name_are_the_served_checkpoint(vllm_url: str, tmp_path: Path):
    """Every HF parameter name, un-fused from vLLM's qkv/gate_up layers (read through vLLM's packed CPU
    kernels: its CPU build keeps no plain copy), equals the checkpoint just loaded; tied lm_head is the
    embedding; an unknown name is a 400 naming it; tp_size > 1 is refused rather than answering a shard."""
    from safetensors.torch import load_file

    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.engine.server.requests import RequestError
    from pipeline.engine.server.vllm.adapter import AdapterConfig, VLLMAdapter
    from pipeline.trainer.publish.verify import UNSUPPORTED

    other = make_tiny_model(tmp_path / "seed5", seed=5)
    checkpoint = load_file(str(other / "model.safetensors"))
    assert "lm_head.weight" not in checkpoint  # tied
    async with EngineClient([vllm_url]) as client:
        await client.update_weights_from_disk(str(other), weight_version=5)
    async with httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
        for name in [*checkpoint, "lm_head.weight"]:
            resp = await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
            assert resp.status_code == 200, resp.text
            want = checkpoint.get(name, checkpoint["model.embed_tokens.weight"])[:3].float()  # served fp32
            assert torch.equal(torch.tensor(resp.json()), want), name
        unknown = await http.post("/get_weights_by_name", json={"name": "model.layers.9.mlp.up_proj.weight"})
    assert unknown.status_code == 400 and "model.layers.9.mlp.up_proj.weight" in unknown.text, unknown.text
    sharded = VLLMAdapter(AdapterConfig(upstream=vllm_url, model_path=str(other), tp_size=2))
    with pytest.raises(RequestError, match="tp_size > 1") as refused:
        await sharded.weights_by_name("model.norm.weight", 3)
    assert UNSUPPORTED in str(refused.value)  # the trainer then verifies this server by the probe only
    await sharded.http.aclose()


async def test_update_from_disk(vllm_url: str, tmp_path: Path):
    from pipeline.demo.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "seed1", seed=1)
    new = load(other)
    async with EngineClient([vllm_url]) as client:
        await client.update_weights_from_disk(str(other), weight_version=2)
        result = await client.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True})
        assert await client.weight_version() == 2
    assert result.weight_version == 2
    assert close(result.output_logprobs, teacher_forced(new, PROMPT, result.output_ids))


async def test_update_from_distributed_over_gloo(vllm_url: str, tmp_path: Path):
    from pipeline.demo.tiny_model import make_tiny_model

    new = load(make_tiny_model(tmp_path / "seed2", seed=2))
    named = [(n, p.detach().contiguous()) for n, p in new.named_parameters()]
    port = free_port()
    async with EngineClient([vllm_url]) as client:
        world = await client.weights_group_world_size()
        join = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, "vllm-wg", "gloo"))
        group = await asyncio.to_thread(
            init_weight_group,
            "127.0.0.1",
            port,
            rank=0,
            world_size=world,
            group_name="vllm-wg",
            backend="gloo",
            timeout_s=300,
        )
        await join
        with pytest.raises(EngineError) as outside:  # no session open (SGLang's rule): refused before receiving
            await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]], "vllm-wg", 9)
        assert outside.value.status == 400 and "/begin_weight_update" in str(outside.value)
        await client.begin_weight_update()
        with pytest.raises(EngineError):  # refused before the broadcast starts: nobody hangs
            await client.update_weights_from_distributed(["nope.weight"], ["float32"], [[1]], "vllm-wg", 9)
        await asyncio.gather(
            client.update_weights_from_distributed(
                [n for n, _ in named],
                [dtype_name(t.dtype) for _, t in named],
                [list(t.shape) for _, t in named],
                "vllm-wg",
                weight_version=3,
            ),
            asyncio.to_thread(broadcast_from_trainer, group, [t for _, t in named]),
        )
        await client.end_weight_update()
        result = await client.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True})
    assert result.weight_version == 3
    assert close(result.output_logprobs, teacher_forced(new, PROMPT, result.output_ids))
    for name, tensor in [*named, ("lm_head.weight", new.lm_head.weight)]:  # what the layerwise reload loaded
        rows = httpx.post(vllm_url + "/get_weights_by_name", json={"name": name, "truncate_size": 2}, timeout=60)
        assert rows.status_code == 200 and torch.equal(torch.tensor(rows.json()), tensor[:2].detach()), name
    # Leaving the group is the same route as on the hf engine: 200 once, then 400 (no such group).
    async with httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
        left = await http.post("/destroy_weights_update_group", json={"group_name": "vllm-wg"})
        again = await http.post("/destroy_weights_update_group", json={"group_name": "vllm-wg"})
    destroy_weight_group(group)
    assert left.status_code == 200 and left.json()["success"] is True, left.text
    assert again.status_code == 400 and "vllm-wg" in again.text, again.text


def test_broadcast_publisher_in_buckets(vllm_url: str, tiny_model_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """arl's publisher against the adapter, in several buckets (pause, begin, buckets, end, verify, continue):
    the version moves only after the last bucket, the trainer's verification passes on the probe and on the
    weights read back, the new weights serve, and the adapter ends unpaused."""
    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.engine.registry import write_entry
    from pipeline.run.paths import RunPaths
    from pipeline.trainer.checkpoint import buckets
    from pipeline.trainer.publish import publisher as publish
    from schemas.engine_api import InferenceEntry

    new = load(make_tiny_model(tmp_path / "seed3", seed=3))
    state = {k: v.detach().clone() for k, v in new.state_dict().items()}
    monkeypatch.setattr(publish, "BUCKET_BYTES", 256 * 1024)
    assert len(buckets(state, publish.BUCKET_BYTES)) > 2
    before = httpx.get(vllm_url + "/model_info").json()["weight_version"]
    versions_seen: list[str] = []  # the served version as each bucket is about to go

    def on_bucket(version: int, index: int) -> None:
        versions_seen.append(httpx.get(vllm_url + "/model_info").json()["weight_version"])

    paths = RunPaths.from_config(str(tmp_path), "vllm", "publish")
    write_entry(paths, "s0", InferenceEntry(url=vllm_url, backend="vllm", model_path=str(tiny_model_dir),
                                            weight_version=0, host="127.0.0.1", pid=os.getpid(),
                                            started_at=time.time()))  # fmt: skip
    options = publish.PublishOptions(verify_model=tiny_model_dir, broadcast_timeout_s=300, on_bucket=on_bucket)
    publisher = publish.make_publisher("nccl", paths, timeout_s=300, tied_embeddings=True, options=options)
    try:
        report = publisher.publish(7, None, state)
    finally:
        publisher.close()
    assert report.servers == [vllm_url] and report.weights_checked > 0, report
    assert len(versions_seen) > 2 and set(versions_seen) == {before}
    info = httpx.get(vllm_url + "/server_info").json()
    assert info["paused"] is False and info["weight_version"] == "7"

    async def generate() -> Any:
        async with EngineClient([vllm_url]) as client:
            return await client.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True})

    result = asyncio.run(generate())
    assert result.weight_version == 7
    assert close(result.output_logprobs, teacher_forced(new, PROMPT, result.output_ids))
