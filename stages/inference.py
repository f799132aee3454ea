"""`arl stage inference`: the inference-server job.

Starts `inference.num_servers` servers of the configured backend (`hf`, `vllm`, `sglang`) on this
node, registers them in `registry/inference/`, and supervises them until SIGTERM/SIGINT, when it
deregisters them first and then stops them. Logs to `logs/inference/attempt_<n>.log`; each server
logs to `logs/inference/server-<i>.attempt_<n>.log`. See `pipeline.engine.launch`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Serve until stopped; returns the exit code (errors propagate to the CLI, which prints them)."""
    from pipeline.config import config_from_run_dir
    from pipeline.logs import setup_logging
    from pipeline.paths import RunPaths

    paths = RunPaths(Path(run_dir))
    attempt = int(os.environ.get("ARL_ATTEMPT", "0")) or paths.next_attempt("inference")
    setup_logging("inference", paths.stage_log("inference", attempt))
    if step is not None:
        logging.getLogger("arl").info("--step %d ignored: the inference stage serves every step", step)
    config = config_from_run_dir(run_dir)

    from pipeline.engine.launch import run_inference

    return run_inference(Path(run_dir), config, attempt=attempt)
