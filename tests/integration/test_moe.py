"""A mixture-of-experts model end to end on CPU: the tiny Qwen3-MoE (`make-tiny-model --arch qwen3_moe`: a router
over 4 experts a layer, top 2) served by the `hf` engine and trained by the torch backend, judged by transformers'
own Qwen3-MoE forward (router included) and by one process against two FSDP2 processes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from pipeline.demo.tiny_model import TINY_EXPERTS, TINY_EXPERTS_PER_TOKEN, make_tiny_model
from pipeline.engine.server.hf.process import start_hf_server
from tests.integration.test_engine_hf_server import assert_close, lp_values, teacher_forced
from tests.integration.test_fsdp import OVERRIDES, train_single_and_sharded


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe")


def test_the_tiny_moe_is_transformers_qwen3_moe(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (
        TINY_EXPERTS, TINY_EXPERTS_PER_TOKEN, True,
    )  # fmt: skip
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_router_logits=True)
    assert len(out.router_logits) == config.num_hidden_layers  # every layer routes
    assert out.router_logits[0].shape[-1] == TINY_EXPERTS


async def test_the_hf_engine_serves_the_moe_as_transformers_computes_it(moe_dir: Path) -> None:
    """Concurrent requests batched together (padding, KV cache): each token's log-probability equals one unbatched
    transformers forward's within 1e-5 (fp32); a token routed otherwise in the batch would differ far more."""
    from transformers import AutoModelForCausalLM

    reference: Any = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    prompts = [[5 + i] * (2 + 5 * i) + [40 + i, 41] for i in range(5)]
    with start_hf_server(moe_dir, max_batch_size=8, seed=0) as server:

        async def one(client: httpx.AsyncClient, prompt: list[int], index: int) -> dict[str, Any]:
            await asyncio.sleep(0.01 * index)  # staggered: later requests join a running batch
            sampling = {"max_new_tokens": 8 + 3 * index, "temperature": 1.0, "ignore_eos": True}
            body = {"input_ids": prompt, "return_logprob": True, "sampling_params": sampling}
            resp = await client.post(server.url + "/generate", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        async with httpx.AsyncClient(timeout=60) as client:
            results = await asyncio.gather(*(one(client, p, i) for i, p in enumerate(prompts)))
    for prompt, data in zip(prompts, results, strict=True):
        assert_close(lp_values(data), teacher_forced(reference, prompt, data["output_ids"]), tol=1e-5)


@pytest.mark.slow
def test_the_torch_backend_trains_the_moe_and_two_fsdp_processes_equal_one(make_train_run: Any, moe_dir: Path) -> None:
    """Router and experts train; FSDP2 over two processes (gloo) lands on one process's weights. The checkpoint is
    transformers' own layout of the model (each layer's experts as fused `gate_up_proj`/`down_proj` tensors), which
    `from_pretrained` and the hf engine load as they are."""
    from transformers import AutoModelForCausalLM

    single, sharded = train_single_and_sharded(make_train_run, [*OVERRIDES, f"model.path={moe_dir}"])
    initial = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).state_dict()
    a = load_file(str(single.checkpoint_dir(2) / "model.safetensors"))
    b = load_file(str(sharded.checkpoint_dir(2) / "model.safetensors"))
    assert a.keys() == b.keys() and a.keys() <= initial.keys()
    routers = [name for name in a if name.endswith("mlp.gate.weight")]
    experts = [name for name in a if ".mlp.experts." in name]
    assert len(routers) == 2 and len(experts) == 4, sorted(a)
    for name in routers + experts:
        assert not torch.equal(a[name], initial[name]), f"{name} did not train"
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)
    trained = AutoModelForCausalLM.from_pretrained(str(single.checkpoint_dir(2)), dtype=torch.float32).eval()
    reloaded = trained.state_dict()
    for name in a:
        assert torch.equal(reloaded[name], a[name]), name
    asyncio.run(_served_after_a_swap(moe_dir, single.checkpoint_dir(2), trained))


async def _served_after_a_swap(moe_dir: Path, checkpoint: Path, trained: Any) -> None:
    """The engine serving the initial MoE swaps in the trained checkpoint from disk and serves its log-probs."""
    from pipeline.engine.client import EngineClient

    prompt = [11, 12, 13, 14]
    with start_hf_server(moe_dir, seed=0) as server:
        async with EngineClient([server.url]) as client:
            # the hub's layout (one tensor per expert, as make-tiny-model and real checkpoints store it), converted
            # by transformers' own mapping, as the run's version 0 is published; then arl's trained checkpoint
            await client.update_weights_from_disk(str(moe_dir), weight_version=1)
            await client.update_weights_from_disk(str(checkpoint), weight_version=2)
            result = await client.generate(prompt, {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True})
    assert result.weight_version == 2
    assert_close(result.output_logprobs, teacher_forced(trained, prompt, result.output_ids), tol=1e-5)


async def test_the_hf_engine_returns_the_experts_each_token_was_routed_to(moe_dir: Path, tiny_model_dir: Path) -> None:
    """SGLang's contract (`return_routed_experts`, `routed_experts_start_len`; `meta_info.routed_experts`: base64 of
    int32 `[positions, layers, top_k]` over `[start, seqlen - 1)`), for requests batched together: each position's
    experts are those transformers' own routers choose in one unbatched forward of the same tokens."""
    import base64

    import numpy as np
    from transformers import AutoModelForCausalLM

    from pipeline.engine.server.hf.routing import capturing, find_routers, per_row

    reference: Any = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    layers = reference.config.num_hidden_layers
    cases = [([5, 6, 7, 8, 9], 0), ([20 + i for i in range(11)], 4), ([40, 41], 2)]
    with start_hf_server(moe_dir, max_batch_size=8, seed=0) as server:

        async def one(client: httpx.AsyncClient, prompt: list[int], start: int) -> dict[str, Any]:
            body = {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": start,
                    "sampling_params": {"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
            resp = await client.post(server.url + "/generate", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        async with httpx.AsyncClient(timeout=60) as client:
            results = await asyncio.gather(*(one(client, p, s) for p, s in cases))
            past = await client.post(server.url + "/generate", json={"input_ids": [5, 6], "return_routed_experts": True,
                                                                       "routed_experts_start_len": 3})  # fmt: skip
            plain = await client.post(server.url + "/generate", json={"input_ids": [5, 6]})
    assert past.status_code == 400 and "routed_experts_start_len=3" in past.text
    assert plain.status_code == 200 and "routed_experts" not in plain.json()["meta_info"]
    routers = find_routers(reference)
    assert len(routers) == layers
    for (prompt, start), data in zip(cases, results, strict=True):
        fed = prompt + data["output_ids"][:-1]  # the last sampled token is never fed through the model
        raw = np.frombuffer(base64.b64decode(data["meta_info"]["routed_experts"]), dtype="<i4")
        got = raw.reshape(-1, layers, TINY_EXPERTS_PER_TOKEN)
        assert got.shape[0] == len(fed) - start
        with torch.no_grad(), capturing(routers, True) as captured:
            reference(input_ids=torch.tensor([fed]))
        assert captured is not None
        want = per_row(captured, 1)[0, start:].numpy()
        assert (got == want).all()

    with start_hf_server(tiny_model_dir, seed=0) as dense:
        resp = httpx.post(
            dense.url + "/generate", json={"input_ids": [5, 6], "return_routed_experts": True}, timeout=60
        )
    assert resp.status_code == 400 and "mixture-of-experts" in resp.text
