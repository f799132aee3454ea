"""Weight updates of the `hf` server: from disk, and over a real 2-process gloo broadcast from a trainer.

After each kind of update, returned logprobs must equal a teacher-forced pass of the *new* weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_process import hf_server_process  # tests/integration is on sys.path (pytest)

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.server.hf.process import ServerHandle, start_hf_server
from pipeline.engine.weight_group import broadcast_from_trainer, dtype_name, init_weight_group
from pipeline.net.addresses import free_port


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as the tiny model, different weights (seed 1): "version 1"."""
    from pipeline.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_seed1") / "m", template="qwen", seed=1)


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def teacher_forced(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt + output])).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
PROMPT = [11, 12, 13, 14]


@pytest.fixture
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_hf_server(tiny_model_dir, seed=0) as handle:
        yield handle


async def test_update_from_disk_serves_new_weights_and_version(server: ServerHandle, other_model_dir: Path):
    new = load(other_model_dir)
    async with EngineClient([server.url]) as client:
        await client.update_weights_from_disk(str(other_model_dir), weight_version=3)
        result = await client.generate(PROMPT, SAMPLING)
        assert await client.weight_version() == 3
    assert result.weight_version == 3
    assert max_diff(result.output_logprobs, teacher_forced(new, PROMPT, result.output_ids)) < 1e-4
    assert httpx.get(server.url + "/model_info").json()["model_path"] == str(other_model_dir)


async def test_bad_checkpoint_is_refused_and_old_weights_stay(
    server: ServerHandle, tiny_model_dir: Path, tmp_path: Path
):
    from pipeline.demo.tiny_model import make_tiny_model

    wider = make_tiny_model(tmp_path / "wide", hidden_size=256)
    old = load(tiny_model_dir)
    async with EngineClient([server.url]) as client:
        with pytest.raises(EngineError) as info:
            await client.update_weights_from_disk(str(wider), weight_version=1)
        assert info.value.status == 400 and "shape mismatch" in str(info.value)
        result = await client.generate(PROMPT, SAMPLING)
    assert result.weight_version == 0
    assert max_diff(result.output_logprobs, teacher_forced(old, PROMPT, result.output_ids)) < 1e-4


async def test_disk_update_waits_for_requests_in_flight(
    server: ServerHandle, tiny_model_dir: Path, other_model_dir: Path
):
    """SGLang semantics: without a pause, the update applies after the running requests finish."""
    old = load(tiny_model_dir)
    long_params = {**SAMPLING, "max_new_tokens": 200}
    async with EngineClient([server.url]) as client:
        running = asyncio.create_task(client.generate(PROMPT, long_params))
        while server.server.scheduler.load()["running"] == 0:
            await asyncio.sleep(0.005)
        await client.update_weights_from_disk(str(other_model_dir), weight_version=1)
        assert running.done()  # the update returned only after the request finished
        result = running.result()
    assert result.weight_version == 0 and len(result.output_ids) == 200
    assert max_diff(result.output_logprobs, teacher_forced(old, PROMPT, result.output_ids)) < 1e-4


async def test_retract_pause_update_continue_switches_weights_mid_request(
    server: ServerHandle, tiny_model_dir: Path, other_model_dir: Path
):
    """Tokens before the update come from the old weights, tokens after from the new ones (KV recomputed)."""
    old, new = load(tiny_model_dir), load(other_model_dir)
    params = {**SAMPLING, "max_new_tokens": 400}
    chunks = []
    async with EngineClient([server.url]) as client:

        async def consume() -> None:
            async for chunk in client.generate_stream(PROMPT, params):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        while len(chunks) < 3:
            await asyncio.sleep(0.001)
        await client._fan_out("POST", "/pause_generation", {"mode": "retract"})
        await client.update_weights_from_disk(str(other_model_dir), weight_version=1)
        await client.continue_generation()
        await task
    ids = [t for c in chunks for t in c.new_ids]
    versions = [c.weight_version for c in chunks for _ in c.new_ids]
    logprobs = [lp for c in chunks for lp in c.new_logprobs]
    switch = versions.index(1)
    assert 0 < switch < len(ids) == 400 and set(versions[switch:]) == {1}
    assert max_diff(logprobs[:switch], teacher_forced(old, PROMPT, ids[:switch])) < 1e-4
    assert max_diff(logprobs[switch:], teacher_forced(new, PROMPT, ids)[switch:]) < 1e-4


@pytest.fixture
def subprocess_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """An hf server in its own process, so this test process can be the trainer (rank 0) of a real group."""
    with hf_server_process(tiny_model_dir, tmp_path / "server.log") as url:
        yield url


@pytest.mark.slow
async def test_update_from_distributed_over_gloo(subprocess_server: str, other_model_dir: Path):
    new = load(other_model_dir)
    port = free_port()
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    async with EngineClient([subprocess_server]) as client:
        world = await client.weights_group_world_size()
        assert world == 2
        joining = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, "wg-test", "gloo"))
        group = await asyncio.to_thread(
            init_weight_group,
            "127.0.0.1",
            port,
            rank=0,
            world_size=world,
            group_name="wg-test",
            backend="gloo",
            timeout_s=60,
        )
        assert await joining == 2
        names = [n for n, _ in named]
        dtypes = [dtype_name(t.dtype) for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        # Outside a session (SGLang's rule): refused before receiving, so the trainer never broadcasts.
        with pytest.raises(EngineError) as outside:
            await client.update_weights_from_distributed(names, dtypes, shapes, "wg-test", weight_version=4)
        assert outside.value.status == 400 and "/begin_weight_update" in str(outside.value)
        await client.begin_weight_update()
        with pytest.raises(EngineError) as info:  # checked before receiving: the trainer is not left hanging
            await client.update_weights_from_distributed(["no.such.weight"], ["float32"], [[2]], "wg-test", 9)
        assert info.value.status == 400 and "no.such.weight" in str(info.value)
        await asyncio.gather(
            client.update_weights_from_distributed(names, dtypes, shapes, "wg-test", weight_version=5),
            asyncio.to_thread(broadcast_from_trainer, group, [t for _, t in named]),
        )
        await client.end_weight_update()
        result = await client.generate(PROMPT, SAMPLING)
        # A second version over the same group works too (the group persists between steps), here in two
        # buckets: the first keeps the served version, the last one sets it.
        await client.begin_weight_update()
        await asyncio.gather(
            client.update_weights_from_distributed(names[:1], dtypes[:1], shapes[:1], "wg-test", None,
                                                   flush_cache=False),
            asyncio.to_thread(broadcast_from_trainer, group, [named[0][1]]),
        )  # fmt: skip
        assert await client.weight_version() == 5
        await asyncio.gather(
            client.update_weights_from_distributed(names[1:2], dtypes[1:2], shapes[1:2], "wg-test", weight_version=6),
            asyncio.to_thread(broadcast_from_trainer, group, [named[1][1]]),
        )
        await client.end_weight_update()
        assert await client.weight_version() == 6
    assert result.weight_version == 5
    assert max_diff(result.output_logprobs, teacher_forced(new, PROMPT, result.output_ids)) < 1e-4


async def test_weight_update_sessions_follow_sglang(server: ServerHandle):
    """One session at a time: a second begin and an end without a begin are refused (400, SGLang's rule)."""
    async with EngineClient([server.url]) as client:
        with pytest.raises(EngineError) as no_session:
            await client.end_weight_update()
        await client.begin_weight_update()
        with pytest.raises(EngineError) as twice:
            await client.begin_weight_update()
        await client.end_weight_update()
        await client.begin_weight_update()  # a closed session can be opened again
        await client.end_weight_update()
    assert no_session.value.status == 400 and "/begin_weight_update" in str(no_session.value)
    assert twice.value.status == 400 and "/end_weight_update" in str(twice.value)


async def test_disk_update_needs_no_session(server: ServerHandle, other_model_dir: Path):
    """As in SGLang, only broadcast updates need a session; a disk load inside an open one works as well."""
    async with EngineClient([server.url]) as client:
        await client.update_weights_from_disk(str(other_model_dir), weight_version=2)
        await client.begin_weight_update()
        await client.update_weights_from_disk(str(other_model_dir), weight_version=3)
        await client.end_weight_update()
        assert await client.weight_version() == 3


async def test_distributed_update_without_a_group_is_refused(server: ServerHandle):
    async with EngineClient([server.url]) as client:
        await client.begin_weight_update()
        with pytest.raises(EngineError) as info:
            await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]], "nope", 1)
        await client.end_weight_update()
    assert info.value.status == 400 and "init_weights_update_group" in str(info.value)
