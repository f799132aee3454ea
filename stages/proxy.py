"""`arl stage proxy`: a standalone proxy for external agents, writing their finished sessions as steps.

Binds to `proxy.host:proxy.port`, registers `registry/proxy/external.json` (URL only, never a key),
accepts `proxy.client_keys`, and publishes a step per `rollout.batch_size` finished sessions
(`pipeline.rollout.external`); each finished session is kept in `state/proxy_spool/` until its step
is published, so a restart loses none. `--step N` fills and publishes exactly step N. See
docs/rollout.md and docs/proxy.md.
"""

from __future__ import annotations

from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Serve until `num_steps` steps are published; returns the exit code."""
    from pipeline.run.logs import run_async
    from pipeline.run.stage import open_stage

    ctx = open_stage("proxy", run_dir, step)

    from pipeline.rollout.external import run_external

    run_async(run_external(ctx))
    return 0
