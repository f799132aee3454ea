"""What a verified weight swap reads from an `hf` server, and how a swap lands: real servers on loopback.

* prompt logprobs (`/generate` with `return_logprob` and `logprob_start_len`) in SGLang's layout, equal to
  a plain transformers forward of the same weights;
* `/get_weights_by_name` rows equal to the parameters (a tied `lm_head.weight` too);
* broadcast updates staged per session: nothing applies before the bucket carrying `weight_version`, and a
  trainer that dies half-way leaves weights and version untouched;
* the `ARL_TEST_CORRUPT_WEIGHTS` hook corrupts one tensor on exactly one server, once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_process import hf_server_process  # tests/integration is on sys.path (pytest)

from pipeline.engine.server.hf.process import ServerHandle, start_hf_server
from pipeline.engine.weight_group import broadcast_from_trainer, init_weight_group
from pipeline.net.addresses import free_port

REPO = Path(__file__).resolve().parents[2]
PROBE = [int(t) for t in torch.randint(3, 500, (32,), generator=torch.Generator().manual_seed(7))]


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def forward_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log_softmax(logits[i - 1])[ids[i]] for i >= 1: one plain transformers forward, fp32."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def generate(url: str, body: dict[str, Any]) -> Any:
    answer = httpx.post(url + "/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def score(url: str, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.7}, **extra}  # fmt: skip
    return dict(generate(url, body)["meta_info"])


def weights(url: str, name: str, truncate_size: int | None = None, method: str = "POST") -> httpx.Response:
    body: dict[str, Any] = {"name": name} if truncate_size is None else {"name": name, "truncate_size": truncate_size}
    return httpx.request(method, url + "/get_weights_by_name", json=body, timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_hf_server(tiny_model_dir, seed=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    return load(tiny_model_dir)


# -- prompt logprobs --------------------------------------------------------------------------------------
def test_prompt_logprobs_equal_a_transformers_forward(server: ServerHandle, reference: Any) -> None:
    """Raw log_softmax of the logits (the request's temperature 0.7 does not scale them), SGLang's layout."""
    meta = score(server.url, PROBE)
    scored = meta["input_token_logprobs"]
    assert [entry[1] for entry in scored] == PROBE
    assert scored[0] == [None, PROBE[0], None]  # nothing precedes the first token
    assert all(entry[2] is None for entry in scored)  # text only with return_text_in_logprobs
    expected = forward_logprobs(reference, PROBE)
    assert max(abs(entry[0] - want) for entry, want in zip(scored[1:], expected, strict=True)) < 1e-4
    assert len(meta["output_token_logprobs"]) == 1
    with_text = score(server.url, PROBE[:4], return_text_in_logprobs=True)["input_token_logprobs"]
    assert [entry[2] for entry in with_text] == [server.server.tokenizer.decode([t]) for t in PROBE[:4]]


def test_a_batch_scores_each_prompt_from_its_own_start(server: ServerHandle, reference: Any) -> None:
    first, second = PROBE, PROBE[5:20][::-1]
    body = {"input_ids": [first, second], "return_logprob": True, "logprob_start_len": [0, 3],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}  # fmt: skip
    a, b = (answer["meta_info"]["input_token_logprobs"] for answer in generate(server.url, body))
    assert [e[1] for e in a] == first and [e[1] for e in b] == second[3:]
    assert a[0][0] is None and b[0][0] is None  # SGLang: the first scored position has no logprob
    assert max(abs(e[0] - w) for e, w in zip(a[1:], forward_logprobs(reference, first), strict=True)) < 1e-4
    assert max(abs(e[0] - w) for e, w in zip(b[1:], forward_logprobs(reference, second)[3:], strict=True)) < 1e-4


def test_scoring_beside_a_running_completion_and_without_generating(server: ServerHandle, reference: Any) -> None:
    """max_new_tokens 0 scores the prompt only; a scored prompt that joins a running batch is still exact."""
    long = {"input_ids": PROBE[:6], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    expected = forward_logprobs(reference, PROBE)

    async def both() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            running = asyncio.create_task(http.post("/generate", json=long))
            while server.server.scheduler.load()["running"] == 0:
                await asyncio.sleep(0.005)
            body = {"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
            scored = (await http.post("/generate", json=body)).json()
            return scored, (await running).json()

    scored, finished = asyncio.run(both())
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    values = [e[0] for e in scored["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(v - w) for v, w in zip(values, expected, strict=True)) < 1e-4
    assert len(finished["output_ids"]) == 300


def test_a_stream_carries_the_scored_prompt_in_every_event(server: ServerHandle, reference: Any) -> None:
    body = {"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0, "stream": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    assert len(events) == 4
    expected = forward_logprobs(reference, PROBE)
    for event in events:
        scored = event["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in scored] == PROBE and scored[0][0] is None
        assert max(abs(e[0] - w) for e, w in zip(scored[1:], expected, strict=True)) < 1e-4


def test_prompt_top_logprobs_and_the_bounds_of_logprob_start_len(server: ServerHandle, reference: Any) -> None:
    meta = score(server.url, PROBE[:8], top_logprobs_num=3)
    top = meta["input_top_logprobs"]
    assert len(top) == 8 and top[0] is None
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(input_ids=torch.tensor([PROBE[:8]])).logits[0].float(), dim=-1)
    for i in range(1, 8):
        values, ids = logprobs[i - 1].topk(3)
        assert [e[1] for e in top[i]] == ids.tolist()
        assert max(abs(e[0] - v) for e, v in zip(top[i], values.tolist(), strict=True)) < 1e-4
    assert score(server.url, PROBE[:8], logprob_start_len=8)["input_token_logprobs"] == []
    past = httpx.post(server.url + "/generate", json={"input_ids": PROBE[:8], "return_logprob": True,
                                                       "logprob_start_len": 9})  # fmt: skip
    assert past.status_code == 400 and "logprob_start_len=9" in past.json()["error"]["message"]
    plain = generate(server.url, {"input_ids": PROBE[:8], "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    assert "input_token_logprobs" not in plain["meta_info"]  # -1 (the default): output logprobs only


# -- /get_weights_by_name ---------------------------------------------------------------------------------
def test_get_weights_by_name_returns_the_first_rows(server: ServerHandle, reference: Any) -> None:
    params = dict(reference.named_parameters(remove_duplicate=False))
    embed = params["model.embed_tokens.weight"]
    assert weights(server.url, "model.embed_tokens.weight", 3).json() == embed[:3].tolist()
    assert weights(server.url, "lm_head.weight", 2, method="GET").json() == embed[:2].tolist()  # tied
    default = weights(server.url, "model.layers.1.mlp.down_proj.weight").json()
    assert default == params["model.layers.1.mlp.down_proj.weight"][:100].tolist()  # SGLang's default: 100
    norm = params["model.norm.weight"]
    assert weights(server.url, "model.norm.weight", 5).json() == norm[:5].tolist()  # a vector: its elements
    assert weights(server.url, "model.norm.weight", 1000).json() == norm.tolist()


def test_get_weights_by_name_refuses_what_it_cannot_answer(server: ServerHandle) -> None:
    unknown = weights(server.url, "model.no_such.weight", 2)
    assert unknown.status_code == 400 and "model.no_such.weight" in unknown.json()["message"]
    negative = weights(server.url, "model.norm.weight", -1)
    assert negative.status_code == 400 and "truncate_size" in negative.json()["message"]


# -- the corruption hook ----------------------------------------------------------------------------------
def test_corruption_hook_fires_once_on_one_server(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers load version 3 at once: exactly one claims the spec and serves +1.0; a reload does not."""
    spec = tmp_path / "corrupt.json"
    spec.write_text(json.dumps({"version": 3, "name": "model.norm.weight"}))
    monkeypatch.setenv("ARL_TEST_CORRUPT_WEIGHTS", str(spec))
    norm = load(tiny_model_dir).model.norm.weight.detach()
    true_first, corrupted_first = norm[0].item(), (norm[0] + 1.0).item()  # float32 arithmetic, as the server
    with start_hf_server(tiny_model_dir) as a, start_hf_server(tiny_model_dir) as b:

        async def load_both(version: int) -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                answers = await asyncio.gather(*(
                    http.post(s.url + "/update_weights_from_disk",
                              json={"model_path": str(tiny_model_dir), "weight_version": version})
                    for s in (a, b)
                ))  # fmt: skip
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]

        asyncio.run(load_both(3))
        firsts = sorted(weights(s.url, "model.norm.weight", 1).json()[0] for s in (a, b))
        assert firsts == [true_first, corrupted_first]
        assert not spec.exists() and Path(f"{spec}.claimed").exists()
        asyncio.run(load_both(3))  # the same version again: the claimed spec fires no more
        assert [weights(s.url, "model.norm.weight", 1).json()[0] for s in (a, b)] == [true_first] * 2


# -- staged broadcast updates -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An hf server in its own process (this test process is the trainer, rank 0), with the corruption
    hook pointed at a file no test has written yet. Yields its URL and that path."""
    workdir = tmp_path_factory.mktemp("verify_server")
    spec = workdir / "corrupt.json"
    with hf_server_process(tiny_model_dir, workdir / "server.log", {"ARL_TEST_CORRUPT_WEIGHTS": str(spec)}) as url:
        yield url, spec


def admin(url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=120)


def bucket(named: dict[str, torch.Tensor], version: int | None, group: str) -> dict[str, Any]:
    return {"names": list(named), "dtypes": ["float32"] * len(named), "shapes": [list(t.shape) for t in named.values()],
            "group_name": group, "weight_version": version}  # fmt: skip


def served_version(url: str) -> str:
    return str(httpx.get(url + "/model_info", timeout=10).json()["weight_version"])


async def join(url: str, group: str) -> Any:
    """Join `group` as rank 0 of 2 while the server joins as rank 1; returns this side's group."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo"}  # fmt: skip
    joined, pg = await asyncio.gather(
        asyncio.to_thread(admin, url, "/init_weights_update_group", body),
        asyncio.to_thread(init_weight_group, "127.0.0.1", port, rank=0, world_size=2, group_name=group,
                          backend="gloo", timeout_s=60),
    )  # fmt: skip
    assert joined.status_code == 200, joined.text
    return pg


async def send(url: str, pg: Any, named: dict[str, torch.Tensor], version: int | None, group: str) -> None:
    answer, _ = await asyncio.gather(
        asyncio.to_thread(admin, url, "/update_weights_from_distributed", bucket(named, version, group)),
        asyncio.to_thread(broadcast_from_trainer, pg, list(named.values())),
    )
    assert answer.status_code == 200, answer.text


def test_a_session_applies_its_buckets_together_at_the_version_bucket(
    process_server: tuple[str, Path], tiny_model_dir: Path
) -> None:
    url, spec = process_server
    old = load(tiny_model_dir)
    norm, embed = old.model.norm.weight.detach() + 0.5, old.model.embed_tokens.weight.detach() * 2.0
    before = weights(url, "model.norm.weight", 200).json()
    spec.write_text(json.dumps({"version": 9, "name": "model.embed_tokens.weight"}))

    async def session() -> None:
        pg = await join(url, "verify-atomic")
        assert admin(url, "/begin_weight_update").status_code == 200
        await send(url, pg, {"model.norm.weight": norm}, None, "verify-atomic")
        assert weights(url, "model.norm.weight", 200).json() == before  # staged, not applied
        assert served_version(url) == "0"
        await send(url, pg, {"model.embed_tokens.weight": embed}, 9, "verify-atomic")
        assert admin(url, "/end_weight_update").status_code == 200

    asyncio.run(session())
    assert weights(url, "model.norm.weight", 200).json() == norm.tolist() and served_version(url) == "9"
    rows = weights(url, "lm_head.weight", 2).json()  # tied: the embedding as it arrived, corrupted by the hook
    assert rows[0][0] == (embed[0, 0] + 1.0).item() and rows[0][1:] == embed[0, 1:].tolist()
    assert rows[1] == embed[1].tolist()
    assert Path(f"{spec}.claimed").exists()


TRAINER_THAT_DIES = """
import sys, torch
from pipeline.engine.weight_group import broadcast_from_trainer, init_weight_group
port, group = int(sys.argv[1]), sys.argv[2]
pg = init_weight_group("127.0.0.1", port, rank=0, world_size=2, group_name=group, backend="gloo", timeout_s=60)
broadcast_from_trainer(pg, [torch.full((128,), 3.0)])  # bucket 1: model.norm.weight
sys.stdin.read()  # until the test closes stdin: then die before bucket 2 is sent
import os; os._exit(1)
"""


def test_a_trainer_dying_after_its_first_bucket_changes_nothing(process_server: tuple[str, Path]) -> None:
    url, _ = process_server
    norm_before, version_before = weights(url, "model.norm.weight", 200).json(), served_version(url)
    port, group = free_port(), "verify-dies"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_THAT_DIES, str(port), group], stdin=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": group, "backend": "gloo"}  # fmt: skip
        assert admin(url, "/init_weights_update_group", body).status_code == 200
        assert admin(url, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert admin(url, "/begin_weight_update").status_code == 200
        first = admin(url, "/update_weights_from_distributed",
                      bucket({"model.norm.weight": torch.zeros(128)}, None, group))  # fmt: skip
        assert first.status_code == 200, first.text
        assert trainer.stdin is not None
        trainer.stdin.close()  # the trainer dies; the server waits for bucket 2 in vain
        second = admin(url, "/update_weights_from_distributed",
                       bucket({"model.embed_tokens.weight": torch.zeros(512, 128)}, 10, group))  # fmt: skip
    finally:
        trainer.wait(timeout=60)
    assert second.status_code == 400, second.text
    message = second.json()["message"]
    assert group in message and "unchanged" in message and "discarded the 1 tensors" in message
    assert admin(url, "/end_weight_update").status_code == 200  # nothing staged is left to apply
    assert weights(url, "model.norm.weight", 200).json() == norm_before and served_version(url) == version_before
    assert admin(url, "/continue_generation").status_code == 200
    answer = generate(url, {"input_ids": PROBE[:4], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert len(answer["output_ids"]) == 3
