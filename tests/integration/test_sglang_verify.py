"""Verified weight swaps, judged by SGLang's own code (SGLang 0.5.23 in `.sglang-venv`).

`sglang_judge.py` serves SGLang's HTTP app, tokenizer manager and scheduler-side logprob and weight code; its
stand-in model is the real tiny checkpoint run with transformers (`sglang_judge_model.py`), so a prompt's
`input_token_logprobs` are the served weights' own, laid out by SGLang's code, and `/get_weights_by_name`
answers what SGLang answers for the checkpoint's model class. arl's own `EngineClient`, publisher and
`Verifier` (pipeline/trainer/publish/verify.py) talk to it over loopback HTTP.

One judge for the module, started with `--corrupt`: once version `CORRUPT_VERSION` is loaded it adds 1.0 to
one MLP weight (a server whose weights went wrong after a publication). Every test that reads log-probabilities
first puts the weights it expects on the judge (a disk load or a publication), so the tests run in any order.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from test_sglang_contract import (  # tests/integration is on sys.path (pytest)
    SGLANG_PYTHON,
    Judge,
    arl_sglang_config,
    client,
    launch_argv,
    start_judge,
    started_together,
)

from pipeline.engine.client import EngineClient, EngineError
from pipeline.net.addresses import free_port
from pipeline.trainer.publish.verify import UNSUPPORTED, Verifier, probe_ids

CORRUPT_VERSION = 900
CORRUPTED = "model.layers.0.mlp.down_proj.weight"
FP32_ATOL = 1e-4

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .sglang-venv: build it with scripts/sglang_venv.sh"),
]


@pytest.fixture(scope="module")
def judges(tiny_model_dir: Path, tiny_llama_arch_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[list[Judge]]:  # fmt: skip
    """The module's three judges (`judge`, `llama_judge`, `bf16_judge`), started together (`started_together`)."""

    def bf16() -> Judge:
        port = free_port("127.0.0.1")
        argv = launch_argv(arl_sglang_config(tiny_model_dir, "model.dtype=bfloat16"), port, tiny_model_dir, 0)
        return Judge(argv, port, tmp_path_factory.mktemp("sglang_verify_bf16"), wait=False)

    with started_together(
        lambda: start_judge(tiny_model_dir, tmp_path_factory.mktemp("sglang_verify"), version=0,
                            options=["--corrupt", f"{CORRUPT_VERSION}:{CORRUPTED}:1.0"], wait=False),
        lambda: start_judge(tiny_llama_arch_dir, tmp_path_factory.mktemp("sglang_verify_llama"), version=0,
                            wait=False),
        bf16,
    ) as started:  # fmt: skip
        yield started


@pytest.fixture(scope="module")
def judge(judges: list[Judge]) -> Judge:
    return judges[0]


@pytest.fixture(scope="module")
def llama_judge(judges: list[Judge]) -> Judge:
    """A judge serving `tiny_llama_arch_dir` (version 0)."""
    return judges[1]


@pytest.fixture(scope="module")
def bf16_judge(judges: list[Judge]) -> Judge:
    """A judge serving the tiny model (version 0) as arl launches SGLang with `model.dtype=bfloat16`."""
    return judges[2]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with other weights (another seed): what a publication changes the served model to."""
    from pipeline.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen_seed7"), template="qwen", seed=7)


@pytest.fixture(scope="module")
def publisher(judge: Judge, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """arl's broadcast publisher (tied embeddings, as the tiny model) with the judge as its one server; it verifies
    every swap (fp32) as the trainer's does."""
    from pipeline.engine.registry import write_entry
    from pipeline.run.paths import RunPaths
    from pipeline.trainer.publish import publisher as publish
    from schemas.engine_api import InferenceEntry

    paths = RunPaths.from_config(str(tmp_path_factory.mktemp("verify_run")), "verify", "publish")
    write_entry(paths, "judge", InferenceEntry(url=judge.url, backend="sglang", model_path=str(tiny_model_dir),
                                               weight_version=0, host="127.0.0.1", pid=judge.proc.pid,
                                               started_at=time.time(), tp_size=1))  # fmt: skip
    options = publish.PublishOptions(verify_model=tiny_model_dir, dtype="float32")
    made = publish.make_publisher("nccl", paths, timeout_s=60, tied_embeddings=True, options=options)
    try:
        yield made
    finally:
        made.close()


def state_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@torch.no_grad()
def hf_logprobs(model_dir: Path, probe: list[int], change: dict[str, float] | None = None) -> list[float]:
    """transformers' fp32 log-probabilities of probe[1:] (each given the tokens before it); `change` adds a
    constant to named parameters first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for name, delta in (change or {}).items():
        model.state_dict()[name].add_(delta)
    ids = torch.tensor([probe])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()


def next_version(judge: Judge) -> int:
    version = int(judge.model_info()["weight_version"]) + 1
    return version + 1 if version == CORRUPT_VERSION else version


async def publish(publisher: Any, judge: Judge, version: int, state: dict[str, torch.Tensor]) -> Any:
    """A publication the publisher verified on the judge: its report."""
    report = await asyncio.to_thread(publisher.publish, version, None, state)
    assert report.servers == [judge.url] and not report.recovered, report
    assert judge.model_info()["weight_version"] == str(version)
    return report


PROBE = probe_ids(512, {501, 503}, seed=0)


# -- what SGLang's code answers -----------------------------------------------------------------------
async def test_probe_logprobs_are_the_served_weights(judge: Judge, tiny_model_dir: Path, other_model_dir: Path) -> None:
    """After a disk load of a checkpoint, SGLang's `input_token_logprobs` of the probe are that checkpoint's
    (transformers fp32 forward), in SGLang's layout: [logprob, token id, text] per position, the first null."""
    async with client(judge) as engine:
        for model_dir in (other_model_dir, tiny_model_dir):
            await engine.update_weights_from_disk(str(model_dir), next_version(judge))
            scored = await engine.score_prompt(judge.url, PROBE)
            assert [entry[1] for entry in scored] == PROBE
            assert scored[0][0] is None and all(isinstance(entry[0], float) for entry in scored[1:])
            assert all(len(entry) == 3 and entry[2] is None for entry in scored)  # no text unless asked
            assert [entry[0] for entry in scored[1:]] == pytest.approx(hf_logprobs(model_dir, PROBE), abs=FP32_ATOL)
    assert hf_logprobs(other_model_dir, PROBE) != pytest.approx(hf_logprobs(tiny_model_dir, PROBE), abs=0.01)


async def test_sglang_reports_the_last_vocab_id_as_zero(judge: Judge) -> None:
    """SGLang's scheduler clips every prompt id >= vocab_size - 1 to 0 in `input_token_logprobs` (meant for
    multimodal hash tokens): a probe holding the last vocab id does not come back as sent, so arl's probe
    must avoid it."""
    probe = [10, 511, 20, 510]
    async with client(judge) as engine:
        scored = await engine.score_prompt(judge.url, probe)
    assert [entry[1] for entry in scored] == [10, 0, 20, 510]
    assert max(PROBE) < 511


async def test_get_weights_by_name_is_unsupported_for_qwen2(judge: Judge) -> None:
    """SGLang 0.5.23's Qwen2 class has no `get_weights_by_name`: the route answers 400 'Get parameter by name
    failed' for every name, known or not."""
    async with client(judge) as engine:
        for name in ("model.layers.0.mlp.up_proj.weight", "no.such.weight"):
            with pytest.raises(EngineError) as refused:
                await engine.weights_by_name(judge.url, name, 2)
            assert refused.value.status == 400 and UNSUPPORTED in str(refused.value), refused.value
    raw = httpx.post(judge.url + "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 2})
    assert (raw.status_code, raw.json()) == (400, {"error": {"message": UNSUPPORTED}})


async def test_a_broadcast_publication_moves_the_probe(judge: Judge, publisher: Any, tiny_model_dir: Path,
                                                      other_model_dir: Path) -> None:  # fmt: skip
    """arl's publisher broadcasts other weights into SGLang's `WeightUpdater`; the probe then scores as they do."""
    async with client(judge) as engine:
        await engine.update_weights_from_disk(str(tiny_model_dir), next_version(judge))
        mark = judge.mark()
        await publish(publisher, judge, next_version(judge), state_of(other_model_dir))
        scored = await engine.score_prompt(judge.url, PROBE)
    loaded = judge.records(mark, "Loaded")
    assert loaded and all(entry["unmatched"] == [] for entry in loaded)  # every tensor landed in the model
    assert {n for entry in loaded for n in entry["names"]} == set(state_of(other_model_dir))
    assert [entry[0] for entry in scored[1:]] == pytest.approx(hf_logprobs(other_model_dir, PROBE), abs=FP32_ATOL)


# -- arl's Verifier against it ------------------------------------------------------------------------
async def test_verifier_passes_a_good_swap(judge: Judge, publisher: Any, tiny_model_dir: Path,
                                           other_model_dir: Path) -> None:  # fmt: skip
    """The probe agrees; the weights cannot be read back (Qwen2), which is recorded, not a failure."""
    verifier = Verifier(tiny_model_dir, "float32", tied=True)
    async with client(judge) as engine:
        for model_dir in (other_model_dir, tiny_model_dir):
            version = next_version(judge)
            state = state_of(model_dir)
            expected = verifier.expect(version, state)
            await publish(publisher, judge, version, state)
            verdict = await verifier.check(engine, judge.url, expected)
            assert verdict.ok and verdict.problem is None, verdict
            assert verdict.probe_max_diff <= FP32_ATOL
    assert verifier.weights_supported == {judge.url: False}


async def test_verifier_names_a_corrupted_server(judge: Judge, publisher: Any, tiny_model_dir: Path) -> None:
    """The judge adds 1.0 to one MLP weight once `CORRUPT_VERSION` is loaded: the publisher's verification fails
    (its one server failing, it announces nothing), and the Verifier's verdict names the probe position and
    both log-probabilities (the server's as the judge serves it, the trainer's as published)."""
    verifier = Verifier(tiny_model_dir, "float32", tied=True)
    state = state_of(tiny_model_dir)
    expected = verifier.expect(CORRUPT_VERSION, state)
    mark = judge.mark()
    async with client(judge) as engine:
        refused = await publish_refused(publisher, engine, state)
        verdict = await verifier.check(engine, judge.url, expected)
        scored = await engine.score_prompt(judge.url, verifier.probe)
    assert "failed verification" in refused and "probe position" in refused, refused
    assert [(r["version"], r["name"]) for r in judge.records(mark, "Corrupted")] == [(str(CORRUPT_VERSION), CORRUPTED)]
    assert not verdict.ok and verdict.problem is not None, verdict
    found = re.search(r"probe position (\d+) \(token (\d+)\): server logprob (\S+), trainer (\S+) ", verdict.problem)
    assert found, verdict.problem
    position, token, server, trainer = int(found[1]), int(found[2]), float(found[3]), float(found[4])
    assert token == verifier.probe[position] and judge.url in verdict.problem
    assert server == pytest.approx(scored[position][0], abs=1e-5)
    assert trainer == pytest.approx(expected.logprobs[position - 1], abs=1e-5)
    corrupted = hf_logprobs(tiny_model_dir, verifier.probe, {CORRUPTED: 1.0})
    assert server == pytest.approx(corrupted[position - 1], abs=FP32_ATOL)  # the judge serves the corrupted model


async def test_a_server_that_failed_verification_is_paused_again(judge: Judge, publisher: Any,
                                                                 tiny_model_dir: Path) -> None:  # fmt: skip
    """SGLang scores only while running, so the publisher resumes it for the probe; when the probe fails the server
    must be paused again (the publisher's rule: nothing answers from weights that failed verification)."""
    mark = judge.mark()
    async with client(judge) as engine:
        await publish_refused(publisher, engine, state_of(tiny_model_dir), settle=judge)
    judge.settle()  # the test's own closing /continue_generation answers before the scheduler reads it
    calls = [r["type"] for r in judge.records(mark) if r["type"] not in ("GetInternalStateReq", "Loaded", "Corrupted")]
    assert "ContinueGenerationReqInput" in calls and calls[-2:] == ["PauseGenerationReqInput",
                                                                    "ContinueGenerationReqInput"], calls  # fmt: skip


async def publish_refused(publisher: Any, engine: EngineClient, state: dict[str, torch.Tensor],
                          settle: Judge | None = None) -> str:  # fmt: skip
    """Publish `CORRUPT_VERSION` (the verifying publisher refuses it), then resume generation (the last call,
    after `settle` records what came before): the ArlError's message."""
    from pipeline.errors import ArlError

    try:
        with pytest.raises(ArlError) as refused:
            await asyncio.to_thread(publisher.publish, CORRUPT_VERSION, None, state)
        if settle is not None:
            settle.settle()
    finally:
        await engine.continue_generation()
    return str(refused.value)


# -- a model class that can show its weights ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama_arch_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `LlamaForCausalLM` checkpoint (tied embeddings) with the tiny model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama_arch")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        max_position_embeddings=config["max_position_embeddings"], tie_word_embeddings=True,
        bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"],
    ))  # fmt: skip
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


async def test_get_weights_by_name_answers_rows_for_llama(tiny_llama_arch_dir: Path, llama_judge: Judge) -> None:
    """SGLang's Llama class implements the route (over its fused q/k/v and gate/up tensors): the answer is the
    checkpoint's first rows, and arl's Verifier reads and checks them."""
    judge = llama_judge
    state = state_of(tiny_llama_arch_dir)
    async with EngineClient([judge.url], health_interval_s=0, request_timeout_s=120) as engine:
        for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.norm.weight", "lm_head.weight"):  # fmt: skip
            rows = await engine.weights_by_name(judge.url, name, 3)
            want = state.get(name, state["model.embed_tokens.weight"])[:3]
            assert torch.equal(torch.tensor(rows, dtype=torch.float32), want.float()), name
        verifier = Verifier(tiny_llama_arch_dir, "float32", tied=True)
        verdict = await verifier.check(engine, judge.url, verifier.expect(0, state))
    assert verdict.ok and verdict.weights_supported is True and verdict.weights_checked > 0, verdict


async def test_verifier_passes_bfloat16_serving(tiny_model_dir: Path, bf16_judge: Judge) -> None:
    """arl's `model.dtype=bfloat16` reaches SGLang's `--dtype`; the judge's model runs in bf16 and its probe is within
    the Verifier's bf16 tolerance of the trainer's fp32 reference, yet not equal to it."""
    verifier = Verifier(tiny_model_dir, "bfloat16", tied=True)
    async with client(bf16_judge) as engine:
        verdict = await verifier.check(engine, bf16_judge.url, verifier.expect(0, state_of(tiny_model_dir)))
    assert verdict.ok, verdict
    assert 1e-5 < verdict.probe_max_diff <= verifier.tol.logprob_atol, verdict
