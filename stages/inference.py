"""`arl stage inference`: the inference-server job.

Starts `inference.num_servers` servers of the configured backend (`hf`, `vllm`, `sglang`) on this
node, registers them in `registry/inference/`, and supervises them until SIGTERM/SIGINT, when it
deregisters them first and then stops them. Logs to `logs/inference/attempt_<n>.log`; each server
logs to `logs/inference/server-<i>.attempt_<n>.log`. `--step` is ignored: the servers serve every
step. See `pipeline.engine.inference.servers` and docs/inference.md.
"""

from __future__ import annotations

from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Serve until stopped; returns the exit code (errors propagate to the CLI, which prints them)."""
    from pipeline.run.stage import open_stage

    ctx = open_stage("inference", run_dir, step)

    from pipeline.engine.inference.servers import run_inference

    return run_inference(ctx)
