"""SGLang judging arl: SGLang's own server, on CPU, with a stand-in for its GPU scheduler.

Runs inside the SGLang venv (`scripts/sglang_venv.sh`); arl never imports it. The contract tests
(`tests/integration/test_sglang_contract.py`) start it as a subprocess and talk to it with arl's own
`EngineClient` over loopback HTTP.

    python sglang_judge.py routes                          SGLang's route table, as JSON
    python sglang_judge.py parse-args -- ARGV...           a `sglang.launch_server` command line through
                                                           SGLang's own parser and checks, as JSON
    python sglang_judge.py check-bodies                    request bodies (a JSON list of {"type", "body"} on
                                                           stdin) as SGLang's HTTP server reads them, as JSON
    python sglang_judge.py serve --record FILE [--corrupt VERSION:NAME:DELTA] -- ARGV...
                                                           SGLang's server for that command line
    python sglang_judge.py answer                          the one-shot modes above, many times: one JSON job
                                                           per stdin line ({"args", "stdin"}), one JSON answer
                                                           per stdout line; SGLang is imported once (~6 s on 2
                                                           cores) and each job runs in a fork of this process

`serve` runs `sglang.srt.entrypoints.http_server.launch_server`, SGLang's own launch path, unchanged
except for the scheduler process it is handed (SGLang takes it as a parameter). So these are SGLang's
own code, as a real server runs them: the command-line parser and its checks; the FastAPI app, every
route, its request validation and error answers; the TokenizerManager (`normalize_batch_and_arguments`,
tokenisation, `SamplingParams.verify`/`normalize`, the pause condition, the weight-update locks and
their dp-size asserts, the version bookkeeping, its communicators, and the building of every `/generate`
answer: meta_info, logprob conversion, cumulative or incremental streams); the DetokenizerManager process
(incremental detokenisation, stop-string and stop-token trimming); and, inside the stand-in, SGLang's `Req`
(its finish rules: stop strings, stop tokens, EOS, max_new_tokens), its logprob result processor (which
prompt positions get a logprob, the null first one, the ids clipped at vocab_size - 1, the last position
dropped), its output streamer (what a scheduler sends per step), its weight-update manager (the begin/end
session rule, the flush after an update, the version record, `get_weights_by_name`), the TP worker's
`get_weights_by_name`, and its model runner's `WeightUpdater` (group join, receive by broadcast) and
`WeightExporter` (`/get_weights_by_name`: None, so a 400, for a model class without the method); SGLang's
model registry picks that class from the checkpoint's architecture.

The model is the checkpoint itself, run with transformers on CPU in `--dtype` (`sglang_judge_model.py`
says how it stands in for SGLang's model class): a prompt's log-probabilities, where a request asks for
them (`logprob_start_len`), are the model's own, computed at the request's first step (its prefill) and
handed to SGLang's logprob processor as SGLang's prefill hands them; every tensor SGLang's `WeightUpdater`
receives, and every tensor of a disk load (read with SGLang's safetensors iterator), is copied into it.
`--corrupt VERSION:NAME:DELTA` adds DELTA to parameter NAME once version VERSION is loaded (a server whose
weights went wrong), recorded as `Corrupted`.

The stand-in (`StandInScheduler`) replaces the batch bookkeeping and the sampler only. The next token is
a deterministic function of the prompt, `sampling_seed` and position (letters A-Z, so text round-trips),
with made-up logprobs (the sampled token first among its top logprobs); a prefill-only request (`max_new_tokens`
0) gets SGLang's dummy token 0 with the model's logprob for it; one decode step every 5 ms.
Modelled on SGLang's scheduler rather than run from it: the request's logprob start
(`Scheduler._handle_generate_request`'s rule), pause (`in_place` holds the running batch, `retract` moves
it to the waiting queue and counts a retraction; continue resumes both), abort (a queued request is
answered at once with SGLang's `_make_abort_req`, a running one ends at its next step with SGLang's
`FINISH_ABORT`), the flush rule (SGLang's `Scheduler.flush_cache`: only when idle, the waiting queue
ignored while paused, evaluated on the stand-in's batch and queue), `/server_info`'s internal state (the
server args plus two placeholder numbers), the ready report (`max_req_input_len` = context - 1), a disk
load (SGLang's own needs its model runner's context) and the begin/end hooks of in-place-quantised weights
(there are none). Every request object SGLang's code hands the scheduler, and every set of tensors SGLang's
`WeightUpdater` hands the model to load (`Loaded`: names, dtypes, shapes, sums, and the names the model has
no tensor for), is appended to the record file, one JSON object a line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

RECORD_ENV = "ARL_SGLANG_JUDGE_RECORD"
CORRUPT_ENV = "ARL_SGLANG_JUDGE_CORRUPT"
STEP_S = 0.005  # one decode step of the stand-in: a stream gets one event per token


def main(argv: list[str]) -> int:
    own, sglang_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("mode", choices=["routes", "parse-args", "check-bodies", "serve", "answer"])
    parser.add_argument("--record", type=Path, help="serve: append every request SGLang's code produced here")
    parser.add_argument("--corrupt", metavar="VERSION:NAME:DELTA",
                        help="serve: once weight version VERSION is loaded, add DELTA to parameter NAME")  # fmt: skip
    args = parser.parse_args(own)
    if args.mode in ONE_SHOT:
        print(
            json.dumps(one_shot(args.mode, sglang_argv, json.load(sys.stdin) if args.mode == "check-bodies" else None))
        )
    elif args.mode == "answer":
        answer()
    else:
        if args.record is None:
            parser.error("serve needs --record FILE")
        if args.corrupt is not None:
            version, name, delta = args.corrupt.split(":")
            os.environ[CORRUPT_ENV] = json.dumps([version, name, float(delta)])
        serve(sglang_argv, args.record)
    return 0


ONE_SHOT = ("routes", "parse-args", "check-bodies")


def one_shot(mode: str, sglang_argv: list[str], stdin: Any) -> dict[str, Any]:
    if mode == "routes":
        return route_table()
    if mode == "parse-args":
        return parse_args(sglang_argv)
    return check_bodies(stdin)


def answer() -> None:
    """The one-shot modes for each job on stdin, each in a fork of this process taken after SGLang's modules are
    imported (the import is what costs): the same functions as one process per job, no state shared between jobs.
    Answers go out on the original stdout; everything SGLang prints goes to stderr."""
    import sglang.srt.arg_groups.overrides
    import sglang.srt.entrypoints.http_server
    import sglang.srt.managers.io_struct
    import sglang.srt.server_args  # noqa: F401
    from forked_jobs import answer_each_in_a_fork

    def run(job: dict[str, Any]) -> dict[str, Any]:
        own, argv = job["args"][:1], job["args"][2:] if job["args"][1:2] == ["--"] else job["args"][1:]
        return one_shot(own[0], argv, job.get("stdin"))

    answer_each_in_a_fork(run)


# -- routes and command lines ----------------------------------------------------------------------
def route_table() -> dict[str, Any]:
    """{"version", "routes": [{"path", "methods"}]} of SGLang's FastAPI app, as `launch_server` serves it."""
    from sglang.srt.entrypoints.http_server import app
    from sglang.version import __version__

    return {"version": __version__, "routes": _flatten(app.routes, "")}


def _flatten(routes: Any, prefix: str) -> list[dict[str, Any]]:
    """Routes with their methods; routers included with `include_router` (FastAPI keeps them nested) opened."""
    out = []
    for route in routes:
        context = getattr(route, "include_context", None)
        if context is not None:
            out += _flatten(route.original_router.routes, prefix + context.prefix)
        else:
            methods = sorted(getattr(route, "methods", None) or ["WEBSOCKET"])
            out.append({"path": prefix + route.path, "methods": methods})
    return out


def parse_args(sglang_argv: list[str]) -> dict[str, Any]:
    """SGLang's reading of a launch command line: {"ok", "error"?, "args"?: the resolved values arl relies on}.

    `prepare_server_args` is what `python -m sglang.launch_server` calls; `resolve_once` and
    `check_server_args` are what its launch runs next. On a machine without a GPU SGLang needs
    `--device cpu` to resolve: it is added when the command line has no `--device`, and only then.
    """
    from sglang.srt.server_args import prepare_server_args

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            server_args = prepare_server_args(list(sglang_argv))
    except SystemExit:  # argparse's answer to an unknown or malformed flag
        error = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return {"ok": False, "stage": "parse", "error": error[-1] if error else stderr.getvalue()[-2000:]}
    raw = {name: _jsonable(getattr(server_args, name, None)) for name in _REPORTED}
    try:
        if server_args.device is None:
            server_args.device = "cpu"
        server_args.resolve_once()
        server_args.check_server_args()
    except Exception as exc:  # SGLang's own checks refuse the combination
        return {"ok": False, "stage": "check", "error": f"{type(exc).__name__}: {exc}", "raw": raw}
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    resolved = {name: _jsonable(getattr(view, name, None)) for name in _REPORTED}
    return {"ok": True, "raw": raw, "resolved": resolved}


_REPORTED = ("model_path", "tokenizer_path", "host", "port", "tp_size", "dp_size", "pp_size", "mem_fraction_static",
             "dtype", "weight_version", "context_length", "incremental_streaming_output", "device", "enable_lora",
             "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "max_loaded_loras")  # fmt: skip


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


# -- request bodies --------------------------------------------------------------------------------
def check_bodies(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """{"version", "results": [{"ok", "error"?, "ignored", "fields"?}]}: each body as SGLang's route reads it.

    A route's body is `Annotated[<io_struct class>, Body()]`; FastAPI validates the parsed JSON with the pydantic
    schema of the class (a msgspec struct's is SGLang's `msgspec_struct_pydantic_core_schema`; `GenerateReqInput`
    is a dataclass): lax, unknown keys dropped (reported here as `ignored`), which is
    `TypeAdapter(cls).validate_python`. A `GenerateReqInput` then goes through
    `normalize_batch_and_arguments`, the tokenizer manager's first step (per-prompt `lora_path` lists).
    """
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct
    from sglang.version import __version__

    results = []
    for entry in entries:
        cls = getattr(io_struct, entry["type"])
        known = getattr(cls, "__struct_fields__", None) or [f.name for f in dataclasses.fields(cls)]
        result: dict[str, Any] = {"ignored": sorted(set(entry["body"]) - set(known))}
        try:
            obj = TypeAdapter(cls).validate_python(entry["body"])
            if isinstance(obj, io_struct.GenerateReqInput):
                obj.normalize_batch_and_arguments()
        except Exception as exc:
            results.append({**result, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append({**result, "ok": True, "fields": _fields(obj)})
    return {"version": __version__, "results": results}


# -- serve -----------------------------------------------------------------------------------------
def serve(sglang_argv: list[str], record: Path) -> None:
    """SGLang's `launch_server` for this command line, with the stand-in scheduler; runs until killed."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    os.environ[RECORD_ENV] = str(record.resolve())  # the scheduler process is spawned: it inherits this
    server_args = prepare_server_args(list(sglang_argv))
    if server_args.device is None:
        server_args.device = "cpu"
    server_args.resolve_once()
    launch_server(server_args, run_scheduler_process_func=run_standin_scheduler)


def run_standin_scheduler(server_args: Any, port_args: Any, gpu_id: int, tp_rank: int, pp_rank: int,
                          dp_rank: int | None, pipe_writer: Any, *args: Any, **kwargs: Any) -> None:  # fmt: skip
    """The scheduler process SGLang's launch spawns; the signature of SGLang's `run_scheduler_process`."""
    from sglang.srt.managers.scheduler import resolve_spawn_dp_rank
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.utils.common import kill_itself_when_parent_died

    kill_itself_when_parent_died()  # as SGLang's scheduler: never outlive the server
    dp_rank = resolve_spawn_dp_rank(dp_rank)
    world_rank = spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=gpu_id))
    try:
        scheduler = StandInScheduler(server_args, port_args, Path(os.environ[RECORD_ENV]))
    except Exception:
        pipe_writer.send({"status": "failed"})
        raise
    pipe_writer.send(scheduler.init_info())
    scheduler.run()


class StandInScheduler:
    """SGLang's scheduler protocol over its own IPC sockets, with SGLang's request and output code inside."""

    def __init__(self, server_args: Any, port_args: Any, record: Path) -> None:
        import torch.distributed as dist
        import zmq
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.runtime_context import get_serving
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer
        from sglang.srt.utils.network import get_zmq_socket
        from sglang_judge_model import StandInModel

        self.server_args = server_args
        self.record_path = record
        self.model_config = ModelConfig.from_server_args(server_args)
        self.model = StandInModel(server_args.model_path, self.model_config.dtype, self.record)
        if os.environ.get(CORRUPT_ENV):
            self.model.corruption = tuple(json.loads(os.environ[CORRUPT_ENV]))  # type: ignore[assignment]
        self.tokenizer = get_tokenizer(get_serving().tokenizer_path)
        context = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.send_to_tokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        send_to_detokenizer = get_zmq_socket(context, zmq.PUSH, port_args.detokenizer_ipc_name, False)
        self.streamer = SchedulerOutputStreamer(
            send_to_detokenizer=_Sender(send_to_detokenizer), tree_cache=None, server_args=server_args,
            is_generation=True, spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL, enable_hicache_storage=lambda: False,
        )  # fmt: skip
        # SGLang's weight-update manager barriers on the TP group and its WeightUpdater asserts a default
        # process group: a one-rank gloo group stands for the TP group of one rank.
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        self.weight_updater = _weight_update_manager(self)
        self.running: list[Any] = []  # SGLang `Req`s, in arrival order
        self.waiting_queue: list[Any] = []  # requests retracted by a pause (new ones start decoding at once)
        self.chunked_req = None
        self.hisparse_coordinator = None
        self.paused: str | None = None
        self.lora_names: dict[str, str] = {}  # lora_id -> name of the loaded LoRA adapters
        self.lora_paths: dict[str, str] = {}  # lora_id -> path

    def init_info(self) -> dict[str, Any]:
        """What a scheduler reports to the launcher when ready (`Scheduler.get_init_info`)."""
        from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout

        max_total = 1 << 20
        return {
            "status": "ready",
            "max_total_num_tokens": max_total,
            "max_req_input_len": min(self.model_config.context_len - 1, max_total - 1),
            "startup_time": None,
            "hicache_object_layout": disabled_l3_layout("Hierarchical cache is disabled", page_size=1),
        }

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        while True:
            busy = bool(self.running) and not self.paused
            if self.recv_from_tokenizer.poll(timeout=int(STEP_S * 1000) if busy else 100):
                while True:
                    try:
                        request = sock_recv(self.recv_from_tokenizer, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.dispatch(request)
            if self.running and not self.paused:
                self.step()

    def dispatch(self, request: Any) -> None:
        from sglang.srt.managers import io_struct as io

        self.record(request)
        handlers = {
            io.TokenizedGenerateReqInput: self.add_request,
            io.BatchTokenizedGenerateReqInput: self.add_batch,
            io.AbortReq: self.abort,
            io.PauseGenerationReqInput: self.pause,
            io.ContinueGenerationReqInput: self.resume,
            io.FlushCacheReqInput: lambda req: io.FlushCacheReqOutput(success=self.flush_cache()),
            io.GetInternalStateReq: self.internal_state,
            io.UpdateWeightFromDiskReqInput: self.weight_updater.update_weights_from_disk,
            io.InitWeightsUpdateGroupReqInput: self.weight_updater.init_weights_update_group,
            io.DestroyWeightsUpdateGroupReqInput: self.weight_updater.destroy_weights_update_group,
            io.BeginWeightUpdateReqInput: self.weight_updater.begin_weight_update,
            io.EndWeightUpdateReqInput: self.weight_updater.end_weight_update,
            io.UpdateWeightsFromDistributedReqInput: self.weight_updater.update_weights_from_distributed,
            io.UpdateWeightVersionReqInput: self.update_weight_version,
            io.GetWeightsByNameReqInput: self.weight_updater.get_weights_by_name,
            io.LoadLoRAAdapterReqInput: self.load_lora_adapter,
            io.UnloadLoRAAdapterReqInput: self.unload_lora_adapter,
        }
        handler = handlers.get(type(request))
        if handler is None:  # requests arl never sends (profiling, sessions, ...): no answer comes
            print(f"stand-in scheduler: no handler for {type(request).__name__}", file=sys.stderr, flush=True)
            return
        output = handler(request)
        if output is not None:
            self.send_control_output(output, request)

    def send_control_output(self, output: Any, request: Any) -> None:
        from sglang.srt.managers.io_struct import sock_send

        if getattr(output, "rid", None) is None and getattr(request, "rid", None) is not None:
            output.rid = request.rid
        sock_send(self.send_to_tokenizer, output)

    # -- generation --------------------------------------------------------------------------------
    def add_request(self, recv: Any) -> None:
        """`Scheduler._handle_generate_request` for a plain request: SGLang's `Req`, as the scheduler builds it."""
        from sglang.srt.managers.schedule_batch import Req

        req = Req(recv.rid, recv.input_text, recv.input_ids, recv.sampling_params,
                  return_logprob=recv.return_logprob, top_logprobs_num=recv.top_logprobs_num,
                  token_ids_logprob=recv.token_ids_logprob, stream=recv.stream,
                  eos_token_ids=self.model_config.hf_eos_token_id, vocab_size=self.model_config.vocab_size,
                  http_worker_ipc=recv.http_worker_ipc, time_stats=recv.time_stats,
                  lora_id=recv.lora_id)  # fmt: skip
        req.tokenizer = self.tokenizer
        # `Scheduler._handle_generate_request`'s rule: without a start, a request asking for logprobs gets its
        # output tokens' only (the prompt's start where the prompt ends)
        if not recv.return_logprob:
            req.logprob_start_len = -1
        elif recv.logprob_start_len == -1:
            prompt_end = recv.token_ids_logprob is None or req.is_prefill_only
            req.logprob_start_len = len(req.origin_input_ids) if prompt_end else -1
        else:
            req.logprob_start_len = recv.logprob_start_len
        if req.logprob_start_len > len(req.origin_input_ids):
            error = (f"{req.logprob_start_len=} is higher than the number of input tokens "
                     f"{len(req.origin_input_ids)=}. Please use a smaller logprob_start_len.")  # fmt: skip
            req.logprob_start_len = -1
            req.set_finish_with_abort(error)
        if req.return_logprob:  # what SGLang's scheduler sets up for a new request's output logprobs
            for name in ("output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val",
                         "output_top_logprobs_idx", "output_token_ids_logprobs_val",
                         "output_token_ids_logprobs_idx"):  # fmt: skip
                if getattr(req.logprob, name) is None:
                    setattr(req.logprob, name, [])
        self.running.append(req)

    def add_batch(self, batch: Any) -> None:
        for recv in batch.batch:
            self.add_request(recv)

    def step(self) -> None:
        """One decode step for every running request, then SGLang's output streamer sends what is due."""
        for req in self.running:
            if req.finished():
                continue
            if req.to_finish is None:
                self.sample(req)
            req.update_finish_state()
        return_logprob = any(req.return_logprob for req in self.running)
        self.streamer.stream_output(self.running, return_logprob)
        self.running = [req for req in self.running if not req.finished()]

    def sample(self, req: Any) -> None:
        """The stand-in sampler: a deterministic letter token with made-up logprobs. The first step is the
        prefill: the prompt's logprobs, where asked for, are the model's (`prefill_logprobs`). A prefill-only
        request (`max_new_tokens` 0) samples nothing: SGLang's TP worker hands back token 0 with its logprob."""
        seed = req.sampling_params.sampling_seed
        position = len(req.output_ids)
        rng = random.Random(f"{list(req.origin_input_ids)}|{seed}|{position}")
        candidates = rng.sample(_LETTER_IDS, len(_LETTER_IDS))
        token = candidates[0]
        logprob = -0.25 - 0.01 * position
        if req.is_prefill_only:
            ids = list(req.origin_input_ids)
            token, logprob = 0, float(self.model.prompt_logprobs(ids, len(ids) - 1, 1, req.lora_id)[0, 0])
        req.output_ids.append(token)
        if req.return_logprob and position == 0:
            self.prefill_logprobs(req, token, logprob, candidates)
        elif req.return_logprob:
            req.logprob.output_token_logprobs_val.append(logprob)
            req.logprob.output_token_logprobs_idx.append(token)
            k = req.logprob.top_logprobs_num
            if k > 0:
                req.logprob.output_top_logprobs_val.append([logprob - 0.5 * j for j in range(k)])
                req.logprob.output_top_logprobs_idx.append(candidates[:k])

    def prefill_logprobs(self, req: Any, token: int, logprob: float, candidates: list[int]) -> None:
        """What SGLang's prefill hands its logprob processor: the extend's logprob start
        (`compute_extend_logprob_start_len`, no cached prefix), the token each position's logprob is for (the
        next prompt token, 0 past the end: `ScheduleBatch.prepare_for_extend`), their log-probabilities (here the
        real model's) and the sampled token's; SGLang's `SchedulerLogprobResultProcessor` then fills the request
        (the None for the first prompt token, the last position dropped) as its prefill result processing does."""
        import torch
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.schedule_batch import compute_extend_logprob_start_len
        from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor

        processor = SchedulerLogprobResultProcessor(model_config=self.model_config)
        ids, n = list(req.origin_input_ids), len(req.origin_input_ids)
        start = compute_extend_logprob_start_len(logprob_start_len=req.logprob_start_len, prefix_len=0,
                                                 extend_len=n, full_untruncated_fill_len=n)  # fmt: skip
        count = processor.calculate_num_input_logprobs(req, n, start)
        k = req.logprob.top_logprobs_num
        input_logprobs, top_val, top_idx = None, None, None
        if count > 0:
            logprob_ids = [*ids[start + 1 : n + 1], 0][:count]
            rows = self.model.prompt_logprobs(ids, start, count, req.lora_id)
            logprob_ids = [min(max(i, 0), rows.shape[1] - 1) for i in logprob_ids]
            input_logprobs = tuple(rows.gather(1, torch.tensor(logprob_ids).unsqueeze(1)).squeeze(1).tolist())
            if k > 0:
                top = rows.topk(k, dim=-1)
                top_val, top_idx = [top.values.tolist()], [top.indices.tolist()]
        output = LogitsProcessorOutput(
            next_token_logits=None, next_token_logprobs=[logprob], input_token_logprobs=input_logprobs,
            next_token_top_logprobs_val=[[logprob - 0.5 * j for j in range(k)]] if k > 0 else None,
            next_token_top_logprobs_idx=[candidates[:k]] if k > 0 else None,
            input_top_logprobs_val=top_val, input_top_logprobs_idx=top_idx,
        )  # fmt: skip
        processor.add_logprob_return_values(0, req, 0, [token], count, output)

    def abort(self, recv: Any) -> None:
        """SGLang's `Scheduler.abort_request`: a queued request is answered at once, a running one ends with
        `FINISH_ABORT` at its next step (SGLang's "abort method 3")."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.managers.scheduler import _make_abort_req

        def hit(req: Any) -> bool:
            return not req.finished() and (recv.abort_all or req.rid.startswith(recv.rid))

        for req in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(req)
            self.send_control_output(_make_abort_req(req, finished_reason=recv.finished_reason), recv)
        for req in self.running:
            if hit(req):
                req.to_finish = FINISH_ABORT()

    def pause(self, recv: Any) -> None:
        """SGLang's `Scheduler.pause_generation`: `in_place` stops decoding and keeps the running batch;
        `retract` moves the running requests back to the waiting queue (their KV freed, recomputed later)."""
        assert recv.mode in ("in_place", "retract")  # as SGLang's: `abort` is handled by the tokenizer manager
        self.paused = recv.mode
        if recv.mode == "retract":
            for req in self.running:
                req.retraction_count += 1
            self.waiting_queue += self.running
            self.running = []

    def resume(self, recv: Any) -> None:
        self.paused = None
        self.running += self.waiting_queue
        self.waiting_queue = []

    def is_fully_idle(self, ignore_waiting: bool = False, **kwargs: Any) -> bool:
        """SGLang's `Scheduler.is_fully_idle` over the stand-in's running batch and waiting queue."""
        return not self.running and (ignore_waiting or not self.waiting_queue)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """SGLang's `Scheduler.flush_cache` rule: only when idle, the waiting queue ignored while paused."""
        return self.is_fully_idle(ignore_waiting=self.paused is not None)

    def internal_state(self, recv: Any) -> Any:
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        state = msgspec_to_builtins({k: _jsonable(v) for k, v in vars(self.server_args).items()})
        state.update({"last_gen_throughput": 0.0, "memory_usage": {}})
        return GetInternalStateReqOutput(internal_state=state)

    # -- LoRA adapters (SGLang's `LoRAManager` answers, its `LoRAConfig` reading the adapter) -------
    def load_lora_adapter(self, recv: Any) -> Any:
        """What SGLang's `LoRAManager._load_lora_adapter` checks and answers; the stand-in model serves the
        adapter's requests (`lora_id`, which SGLang's tokenizer manager resolves from the request's name)."""
        from sglang.srt.lora.lora_config import LoRAConfig

        try:
            config = LoRAConfig(recv.lora_path, base_vocab_size=self.model_config.vocab_size)
            if recv.lora_name in self.lora_names.values():
                raise ValueError(f"Failed to load LoRA adapter {recv.lora_name} because it is already loaded")
            rank = config.hf_config["r"]
            if rank > (self.server_args.max_lora_rank or 0):
                raise ValueError(f"LoRA adapter {recv.lora_name} has rank {rank} > --max-lora-rank")
            self.model.add_adapter(recv.lora_id, recv.lora_path, config.hf_config)
        except Exception as e:
            return self.lora_result(False, str(e))
        self.lora_names[recv.lora_id] = recv.lora_name
        self.lora_paths[recv.lora_id] = recv.lora_path
        return self.lora_result(True)

    def unload_lora_adapter(self, recv: Any) -> Any:
        self.lora_names.pop(recv.lora_id, None)
        self.lora_paths.pop(recv.lora_id, None)
        self.model.adapters.pop(recv.lora_id, None)
        return self.lora_result(True)

    def lora_result(self, success: bool, error: str = "") -> Any:
        """`LoRAManager.create_lora_update_result`: name -> path of every loaded adapter."""
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        loaded = {self.lora_names[i]: self.lora_paths[i] for i in self.lora_names}
        return LoRAUpdateOutput(success=success, error_message=error, loaded_adapters=loaded)

    # -- weight versions (SGLang's own scheduler methods, run on this object) ----------------------
    def update_weight_version(self, recv: Any) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqOutput

        self.record_weight_version_change(recv.new_version)
        return UpdateWeightVersionReqOutput()

    def record_weight_version_change(self, new_version: str | None) -> None:
        from sglang.srt.managers.scheduler import Scheduler

        Scheduler.record_weight_version_change(self, new_version)  # type: ignore[arg-type]
        self.model.corrupt_at(new_version)

    def collect_inflight_reqs(self) -> set[Any]:
        return set(self.running)

    # -- the record --------------------------------------------------------------------------------
    def record(self, request: Any) -> None:
        items = getattr(request, "batch", None)
        if isinstance(items, list):  # SGLang's batched form: one entry per request it carries, with the batch's size
            for item in items:
                self._write(item, batch=len(items))
            return
        self._write(request)

    def _write(self, request: Any, **extra: Any) -> None:
        entry = {"type": type(request).__name__.lstrip("_"), "time": time.time(), **_fields(request), **extra}
        with open(self.record_path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


_LETTER_IDS = list(range(32, 58))  # byte-level tokens 'A'..'Z' of the tiny test tokenizer


def _fields(obj: Any) -> dict[str, Any]:
    """A request object's fields as JSON values (SamplingParams as its attributes)."""
    out: dict[str, Any] = {}
    names = getattr(obj, "__struct_fields__", None) or list(_attributes(obj))
    for name in names:
        value = getattr(obj, name, None)
        if name in ("time_stats", "mm_inputs", "positional_embed_overrides"):
            continue
        if type(value).__name__ == "SamplingParams":
            value = {k: _plain(v) for k, v in _attributes(value).items() if not k.startswith("_")}
        out[name] = _plain(value)
    return out


def _attributes(obj: Any) -> dict[str, Any]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if n not in names]
    return {n: getattr(obj, n) for n in names if hasattr(obj, n)}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    try:
        return [_plain(v) for v in list(value)]  # array('q'), numpy arrays
    except TypeError:
        return repr(value)


class _Sender:
    """What SGLang's output streamer sends through (`send_output(payload)`)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket

    def send_output(self, payload: Any, *args: Any) -> None:
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.socket, payload)


def _weight_update_manager(scheduler: StandInScheduler) -> Any:
    """SGLang's `SchedulerWeightUpdaterManager` over one stand-in runner with SGLang's own `WeightUpdater`."""
    import types

    import torch.distributed as dist
    from sglang.srt.managers.scheduler_components import weight_updater as module
    from sglang.srt.managers.tp_worker import TpModelWorker

    runner = _standin_runner(scheduler)
    worker = types.SimpleNamespace(
        model_runner=runner,
        get_weights_by_name=lambda req: TpModelWorker.get_weights_by_name(worker, req),  # type: ignore[arg-type]
        weight_update_runners=lambda: [("target", runner)],
        init_weights_update_group=lambda req: runner.weight_updater.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend),
        destroy_weights_update_group=lambda req: runner.weight_updater.destroy_weights_update_group(req.group_name),
    )  # fmt: skip
    real_get_parallel = module.get_parallel
    module.get_parallel = lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD))
    try:
        return module.SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=scheduler.flush_cache,
            is_fully_idle=scheduler.is_fully_idle, scheduler=scheduler,
        )  # fmt: skip
    finally:
        module.get_parallel = real_get_parallel


def _standin_runner(scheduler: StandInScheduler) -> Any:
    """A model runner over the stand-in model; its `WeightUpdater` and `WeightExporter` are SGLang's."""
    import functools
    import types

    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang_judge_model import sglang_view

    class StandInWeightUpdater(WeightUpdater):
        """SGLang's WeightUpdater; only a disk load and the session hooks of in-place-quantised weights (none
        here) are stood in for. A disk load reads the directory's safetensors with SGLang's iterator into the
        model (SGLang's own path needs its model runner's context)."""

        def update_weights_from_disk(self, model_path: str, load_format: Any, recapture_cuda_graph: bool = False):
            files = sorted(str(f) for f in Path(model_path).glob("*.safetensors"))
            if not (Path(model_path) / "config.json").is_file() or not files:
                return False, f"Failed to get weights iterator: {model_path} has no config.json and safetensors."
            try:
                self.get_model().load_weights(safetensors_weights_iterator(files))
            except Exception as e:
                return False, f"Failed to update weights: {e}."
            return True, "Succeeded to update model weights."

        def begin_weight_update(self) -> None:
            pass

        def end_weight_update(self, *, run_post_load: bool) -> None:
            pass

    model = scheduler.model
    updater = StandInWeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None, get_model_runner=lambda: None,
    )  # fmt: skip
    # the registry resolves the checkpoint's class on first use (importing SGLang's model modules takes seconds)
    view = functools.cache(lambda: sglang_view(model, scheduler.model_config))
    exporter = WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: scheduler.server_args.model_path,
                              get_model=view)  # fmt: skip
    return types.SimpleNamespace(weight_updater=updater, weight_exporter=exporter, model=model)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
