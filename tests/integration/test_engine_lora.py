"""The `hf` engine's LoRA routes (SGLang's `/load_lora_adapter`, `/unload_lora_adapter`, `/update_weight_version`,
`/generate`'s `lora_path`) against PEFT itself: a real server, real PEFT adapters saved by `save_pretrained`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.engine.server.hf.process import start_hf_server

PROMPT = [5, 17, 42, 99, 7, 64, 3, 250, 12, 31, 8, 77]


def make_adapter(base: Path, out: Path, seed: int, targets: Any = "all-linear", rank: int = 4) -> Path:
    """A PEFT adapter of `base` whose B matrices are random (PEFT starts them at zero: that would be the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(str(out))
    return out


@torch.no_grad()
def peft_prompt_logprobs(base: Path, adapter: Path | None) -> list[float]:
    """PEFT's base + adapter (or the base alone): each prompt token's log-probability after the first."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    logits = model.eval()(input_ids=torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()


def scored(client: httpx.Client, lora: str | None) -> list[float]:
    body: dict[str, Any] = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                            "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    if lora is not None:
        body["lora_path"] = lora
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    return [row[0] for row in answer.json()["meta_info"]["input_token_logprobs"][1:]]


def worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    handle = start_hf_server(tiny_model_dir, max_batch_size=16)
    yield handle
    handle.stop()


def test_each_request_is_served_by_the_adapter_it_names(server: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    one = make_adapter(tiny_model_dir, tmp_path / "one", seed=1)
    two = make_adapter(tiny_model_dir, tmp_path / "two", seed=2, targets=["q_proj", "v_proj"], rank=2)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, path in (("arl-lora-v1", one), ("arl-lora-v2", two)):
            answer = client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert answer.status_code == 200, answer.text
        assert answer.json() == {"success": True, "error_message": None,
                                 "loaded_adapters": {"arl-lora-v1": str(one), "arl-lora-v2": str(two)}}  # fmt: skip
        for name, path in (("arl-lora-v1", one), ("arl-lora-v2", two), (None, None)):
            assert worst(scored(client, name), peft_prompt_logprobs(tiny_model_dir, path)) < 1e-5
        assert worst(scored(client, "arl-lora-v1"), scored(client, None)) > 0.01  # the adapter changes the model

        # A batch mixing both adapters and the base, sampled: each row's tokens carry its adapter's version.
        body = {"input_ids": [PROMPT] * 3, "lora_path": ["arl-lora-v1", None, "arl-lora-v2"], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}  # fmt: skip
        client.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False})
        rows = client.post("/generate", json=body).json()
        assert [r["meta_info"]["weight_version_spans"] for r in rows] == [[[0, 1]], [[0, 7]], [[0, 2]]]
        assert client.get("/model_info").json()["weight_version"] == "7"

        gone = client.post("/unload_lora_adapter", json={"lora_name": "arl-lora-v1"})
        assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {"arl-lora-v2": str(two)}
        refused = client.post("/generate", json={"input_ids": PROMPT, "lora_path": "arl-lora-v1"})
        assert refused.status_code == 400 and "not loaded" in refused.json()["error"]["message"]
        client.post("/unload_lora_adapter", json={"lora_name": "arl-lora-v2"})


def test_a_bad_adapter_is_refused_with_the_reason_and_nothing_changes(server: Any, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    good = make_adapter(tiny_model_dir, tmp_path / "good", seed=3)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        cases = [
            ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "not a PEFT adapter directory"),
            ({"lora_name": "x"}, "lora_path"),
            ({"lora_name": "", "lora_path": str(good)}, "lora_name"),
            ({"lora_name": "x", "lora_path": str(good), "extra": 1}, "extra"),
        ]
        for body, needle in cases:
            answer = client.post("/load_lora_adapter", json=body)
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["success"] is False and needle in answer.json()["error_message"], answer.text
        assert client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(good)}).status_code == 200
        twice = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(good)})
        assert twice.status_code == 400 and "already loaded" in twice.json()["error_message"]
        unknown = client.post("/unload_lora_adapter", json={"lora_name": "nope"})
        assert unknown.status_code == 400 and unknown.json()["loaded_adapters"] == {"x": str(good)}
        client.post("/unload_lora_adapter", json={"lora_name": "x"})
        assert client.get("/server_info").json()["lora_adapters"] == {}


def test_an_adapter_of_another_model_is_refused(server: Any, tmp_path: Path) -> None:
    from pipeline.demo.tiny_model import make_tiny_model

    smaller = make_tiny_model(tmp_path / "smaller", hidden_size=64, num_layers=3)
    wider = make_adapter(smaller, tmp_path / "wider", seed=4, targets=["q_proj"], rank=3)
    deeper = make_adapter(smaller, tmp_path / "deeper", seed=4, targets=["layers.2.self_attn.q_proj"], rank=3)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = scored(client, None)
        for path, needle in ((wider, "the served layer maps 128 -> 128"), (deeper, "no module of the served model")):
            answer = client.post("/load_lora_adapter", json={"lora_name": "other", "lora_path": str(path)})
            assert answer.status_code == 400 and needle in answer.json()["error_message"], answer.text
        assert scored(client, None) == before and client.get("/server_info").json()["lora_adapters"] == {}


def unload_during_a_request(url: str, adapter: Path, tokens: int) -> tuple[list[str], httpx.Response, httpx.Response]:
    """Start a streamed request on adapter `busy`, unload `busy` once it streams, ask for `busy` again: the order in
    which the generation and the unload ended, the unload's answer, the new request's answer."""
    order: list[str] = []

    async def unload(client: httpx.AsyncClient) -> httpx.Response:
        answer = await client.post("/unload_lora_adapter", json={"lora_name": "busy"})
        order.append("unload")
        return answer

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await client.post("/load_lora_adapter", json={"lora_name": "busy", "lora_path": str(adapter)})
            long = {"input_ids": PROMPT, "lora_path": "busy", "stream": True,
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip
            async with client.stream("POST", "/generate", json=long) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data:"):  # the request runs on the adapter now
                    pass
                unloading = asyncio.create_task(unload(client))
                await asyncio.sleep(0.2)
                refused = await client.post("/generate", json={"input_ids": PROMPT, "lora_path": "busy"})
                async for _ in lines:
                    pass
                order.append("generation")
            return await unloading, refused

    unloaded, refused = asyncio.run(go())
    return order, unloaded, refused


def test_unload_waits_for_the_requests_the_adapter_serves(server: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    order, unloaded, refused = unload_during_a_request(server.url, make_adapter(tiny_model_dir, tmp_path / "a", 5), 300)
    assert order == ["generation", "unload"]  # the adapter served its request to the end
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {}
    assert refused.status_code == 400 and "not loaded" in refused.text  # no new request once unloading
