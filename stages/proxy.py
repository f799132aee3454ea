"""`arl stage proxy`: a standalone proxy for external agents, writing their finished sessions as steps.

Binds to `proxy.host:proxy.port`, registers `registry/proxy/external.json` (URL only, never a key),
accepts `proxy.client_keys`, and publishes a step per `rollout.batch_size` finished sessions
(`pipeline.rollout.external`); each finished session is kept in `state/proxy_spool/` until its step
is published, so a restart loses none. `--step N` fills and publishes exactly step N.
"""

from __future__ import annotations

import os
from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Serve until `num_steps` steps are published; returns the exit code."""

    from pipeline.config import config_from_run_dir
    from pipeline.logs import run_async, setup_logging
    from pipeline.paths import RunPaths

    paths = RunPaths(Path(run_dir))
    attempt = int(os.environ.get("ARL_ATTEMPT", "0")) or paths.next_attempt("proxy")
    setup_logging("proxy", paths.stage_log("proxy", attempt))
    config = config_from_run_dir(run_dir)
    if not config.proxy.client_keys:
        from pipeline.errors import ConfigError

        raise ConfigError("proxy.client_keys is empty: external agents need a client key to start sessions")

    from pipeline.rollout.external import run_external

    run_async(run_external(config, paths, only_step=step))
    return 0
