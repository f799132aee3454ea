"""`arl eval RUN_DIR`: one checkpoint of a run on its evaluation sets, with an engine of its own.

The weights: `--step K` (version K's checkpoint; 0 = the run's initial model), `--checkpoint PATH` (any
Hugging Face model dir, e.g. a copy kept outside the run), or by default the newest complete checkpoint.
The run's config gives everything else: the agent, the engine backend, the proxy, the sets (`eval.sets`;
`--set NAME` for one). The command starts one inference server of the run's backend on a free port (its log
in `logs/eval/`), the proxy in this process, runs every set (`pipeline.eval.runner`), and stops both. It
never touches the run's registry, shards or checkpoints, so it may run beside a live run (on other cores).

Written: each set's rows as shards in `eval/step_<version>/<set>/` (the trajectory schema, a manifest whose
`extra` holds the figures; `arl inspect` reads them), and one line per set appended to `metrics/eval.jsonl`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import ArlError
from pipeline.eval.results import EVAL_STAGE, metrics_line, open_sinks, record, sink_figures
from pipeline.eval.runner import SetResult, Where, evaluate_set
from pipeline.run.paths import RunPaths, is_adapter_dir, parse_step_name
from schemas.config import ArlConfig, EvalSetConfig


def eval_command(run_dir: Path, *, step: int | None, checkpoint: Path | None, set_name: str | None, fmt: str) -> int:
    """Check the arguments (one-line errors, before anything starts), evaluate, write, print."""
    from pipeline.run.config import config_from_run_dir

    if step is not None and checkpoint is not None:
        raise ArlError("give --step or --checkpoint, not both")
    paths = RunPaths(run_dir.resolve())
    config = config_from_run_dir(paths.root)
    sets = pick_sets(config, set_name)
    model_path, version = pick_weights(paths, config, step, checkpoint)
    from pipeline.run.logs import run_async

    results = run_async(evaluate_checkpoint(paths, config, sets, model_path, version))
    sinks = open_sinks(paths, config)
    try:
        for result in results:
            record(paths, config, result, model_path)
            sinks.log(result.version, sink_figures(result))
    finally:
        sinks.close()
    print_results(results, fmt, model_path)
    return 0


def pick_sets(config: ArlConfig, name: str | None) -> list[EvalSetConfig]:
    sets = config.eval.sets
    if not sets:
        raise ArlError(
            "the run's config has no evaluation sets: add `eval.sets` (a name and a path each; "
            "docs/evaluation.md) and resume the run, or launch one with them"
        )
    if name is None:
        return list(sets)
    chosen = [s for s in sets if s.name == name]
    if not chosen:
        raise ArlError(
            f"no evaluation set named {name!r} in the run's config; it has: {', '.join(s.name for s in sets)}"
        )
    return chosen


def pick_weights(paths: RunPaths, config: ArlConfig, step: int | None, checkpoint: Path | None) -> tuple[str, int]:
    """(model dir, weight version) to evaluate; a one-line error for one that is not there (or not complete)."""
    complete = paths.complete_checkpoints()
    if checkpoint is not None:
        if not (checkpoint / "config.json").is_file() and not is_adapter_dir(checkpoint):
            raise ArlError(
                f"--checkpoint {checkpoint}: not a model directory (no config.json) nor a LoRA "
                "checkpoint (no adapter_config.json)"
            )
        version = parse_step_name(checkpoint.resolve().name)
        if version is None:
            raise ArlError(
                f"--checkpoint {checkpoint}: its name must be the checkpoint's, step_<version> "
                "(e.g. step_000040), so the results can name the version"
            )
        return str(checkpoint.resolve()), version
    if step is None:
        return (str(paths.weights_dir(complete[-1])), complete[-1]) if complete else (config.model.path, 0)
    if step == 0:
        return config.model.path, 0
    if step not in complete:
        kept = ", ".join(map(str, complete)) or "none"
        raise ArlError(
            f"no complete checkpoint of version {step} in {paths.checkpoints} (complete: {kept}; "
            "trainer.keep_checkpoints decides how many are kept)"
        )
    return str(paths.weights_dir(step)), step


async def evaluate_checkpoint(
    paths: RunPaths, config: ArlConfig, sets: list[EvalSetConfig], model_path: str, version: int
) -> list[SetResult]:
    """Start an engine on the weights and a proxy before it, evaluate every set in turn, stop both."""
    from pipeline.engine.client import EngineClient
    from pipeline.engine.inference.servers import ServerStart, start_server, wait_healthy
    from pipeline.engine.inference.supervise import load_adapter, terminate
    from pipeline.net.addresses import free_port
    from pipeline.proxy.server import ProxyServer
    from pipeline.proxy.services import agent_http_client

    attempt = len(list(paths.stage_logs(EVAL_STAGE).glob("server-0.attempt_*.log"))) + 1
    start = ServerStart(index=0, port=free_port(), model_path=model_path, version=version, attempt=attempt)
    server = start_server(paths, config, start, stage=EVAL_STAGE)
    try:
        await asyncio.to_thread(wait_healthy, [server], config.inference.startup_timeout_s, threading.Event())
        adapter = server.adapter[0] if server.adapter else None  # a LoRA checkpoint: base + this adapter
        with httpx.Client() as client:
            await asyncio.to_thread(load_adapter, client, server)
        async with EngineClient(
            [server.url],
            request_timeout_s=config.inference.request_timeout_s,
            adapter=(lambda: adapter) if adapter else None,
        ) as engine:
            proxy = ProxyServer(
                config.model,
                config.proxy.model_copy(update={"port": 0}),
                engine,
                admin_key="arl-eval-" + secrets.token_urlsafe(16),
            )
            url = await proxy.start()
            http = agent_http_client(
                max(s.run_timeout_s for s in sets) + 60,
                proxy_url=url,
                proxy_app=proxy.app,
                transport=config.rollout.agent_transport,
            )
            try:
                where = Where(proxy.control, url, http)
                return [await evaluate_set(spec, config, where, version) for spec in sets]
            finally:
                await http.aclose()
                await proxy.stop()
    finally:
        await asyncio.to_thread(terminate, server)


def print_results(results: list[SetResult], fmt: str, model_path: str) -> None:
    from pipeline.run.console import people_console

    if fmt == "json":
        lines = [
            {"step": r.version, **metrics_line(r.version, r.name, {**r.figures, "weights": model_path})}
            for r in results
        ]
        print(json.dumps(lines, indent=2))
        return
    from rich.table import Table

    keys = sorted({k for r in results for k in r.figures if k.startswith(("pass@", "agent/"))})
    table = Table(title=f"arl eval: {model_path} (version {results[0].version if results else '?'})")
    for column in ("set", "prompts", "runs", "failed", "reward", *keys):
        table.add_column(column, justify="left" if column == "set" else "right")
    for r in results:
        f = r.figures
        table.add_row(
            r.name,
            str(f["prompts"]),
            str(f["runs"]),
            str(f["failed_runs"]),
            _num(f["reward_mean"]),
            *(_num(f.get(k)) for k in keys),
        )
    people_console().print(table)


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"
