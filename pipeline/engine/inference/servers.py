"""The inference stage: start `inference.num_servers` servers on this node, register them, supervise them.

Every server runs in its own subprocess, whatever the backend, also for `num_servers: 1`: a
server that crashes (out of memory, a CUDA fault, a segfault in a kernel) must not take the
supervisor with it, because the supervisor is what deregisters it and tells the log why. It
also makes `hf`, `sglang` and `vllm` one code path.

Life of the stage:
1. weights: the newest complete checkpoint and its version (resume), else `model.path` at 0;
2. start the processes, each logging to `logs/inference/server-<i>.attempt_<n>.log`;
3. wait until each answers `/health` (deadline `inference.startup_timeout_s`; the error names
   the server and its log, and a process that exits early fails the wait at once);
4. publish `registry/inference/<host>-<port>.json` atomically for each;
5. supervise (`supervise.py`): a server that crashes, or that the trainer takes out because a weight
   swap failed on it, is deregistered and restarted from the newest checkpoint (at most
   `inference.max_restarts` times); a server failing three health checks in a row is deregistered
   until it answers again; when none is left, exit 1;
6. on SIGTERM / SIGINT: deregister everything first, then stop the processes (by pid).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from pipeline.engine.inference.orphans import retire_orphans
from pipeline.engine.inference.placement import gpu_env, server_indices
from pipeline.engine.inference.procs import ProcSpec, server_procs
from pipeline.engine.inference.supervise import (
    RunningServer,
    Supervisor,
    deregister,
    healthy,
    load_adapter,
    register,
    tail,
    terminate,
)
from pipeline.errors import ArlError, WaitTimeout
from pipeline.net.addresses import free_port, port_is_free, public_host
from pipeline.run.paths import RunPaths, is_adapter_dir
from pipeline.run.stage import StageContext
from schemas.config import ArlConfig
from schemas.engine_api import InferenceEntry, lora_adapter_name

log = logging.getLogger("arl.engine.launch")
_HEALTH_STRIKES = 3
_POLL_S = 1.0


class ServerDied(ArlError):
    """An inference server process exited while the stage was starting it."""


@dataclass(frozen=True)
class ServerStart:
    """Which server `start_server` starts, where, and on which weights."""

    index: int
    """The server's index on this node (its GPUs, its log's name)."""
    port: int
    """The port it listens on."""
    model_path: str
    """The weights it serves: a model directory, or a LoRA checkpoint (served as the base + that adapter)."""
    version: int
    """The weight version of `model_path`."""
    attempt: int
    """The stage's attempt (in the log's name)."""


def initial_weights(paths: RunPaths, config: ArlConfig) -> tuple[str, int]:
    """(model dir, version) to serve first: the newest complete checkpoint, else the initial model."""
    versions = paths.complete_checkpoints()
    if versions:
        return str(paths.weights_dir(versions[-1])), versions[-1]
    return config.model.path, 0


def run_inference(ctx: StageContext, *, stop: threading.Event | None = None) -> int:
    """The `inference` stage: run until stopped (signal or `stop`, for embedders); returns the exit code."""
    paths, config, attempt = ctx.paths, ctx.config, ctx.attempt
    stop = stop or threading.Event()
    model_path, version = initial_weights(paths, config)
    log.info(
        "serving %s (weight version %d) with %d %s server(s)",
        model_path,
        version,
        config.inference.num_servers,
        config.inference.backend,
    )
    servers: list[RunningServer] = []
    restore = _install_signal_handlers(stop)
    retire_orphans(paths, attempt)
    try:
        for index, port in zip(server_indices(config), _ports(config), strict=True):
            start = ServerStart(index=index, port=port, model_path=model_path, version=version, attempt=attempt)
            servers.append(start_server(paths, config, start))
        wait_healthy(servers, config.inference.startup_timeout_s, stop)
        if stop.is_set():  # stopped while starting: nothing was ready, nothing is registered
            log.info("stop requested while the servers were starting: stopping them")
            return 0
        with httpx.Client() as http:
            for server in servers:
                load_adapter(http, server)
        for server in servers:
            register(paths, server)
        log.info("inference servers ready: %s", ", ".join(s.url for s in servers))

        def restart(old: RunningServer) -> RunningServer:
            path, weights = initial_weights(paths, config)
            start = ServerStart(index=old.index, port=old.port, model_path=path, version=weights, attempt=attempt)
            return start_server(paths, config, start)

        supervisor = Supervisor(
            paths,
            servers,
            restart,
            max_restarts=config.inference.max_restarts,
            startup_timeout_s=config.inference.startup_timeout_s,
        )
        code = supervisor.run(stop)
        servers = supervisor.live
        return code
    finally:
        for server in servers:
            deregister(paths, server)
        for server in servers:
            terminate(server)
        restore()


def _ports(config: ArlConfig) -> list[int]:
    """One free port per server: from `inference.port` upwards, or any free port when it is 0."""
    inf = config.inference
    ports: list[int] = []
    candidate = inf.port
    while len(ports) < inf.num_servers:
        port = free_port(inf.host) if inf.port == 0 else candidate
        candidate += 1
        if port not in ports and port_is_free(inf.host, port):
            ports.append(port)
        if candidate > 65535:
            raise ArlError(f"no free ports from {inf.port} upwards on {inf.host} for {inf.num_servers} servers")
    return ports


def start_server(paths: RunPaths, config: ArlConfig, start: ServerStart, *, stage: str = "inference") -> RunningServer:
    """Start server `start.index`'s processes (not waiting for them), logging to `logs/<stage>/server-<index>...`."""
    inf = config.inference
    index, port, model_path, version, attempt = start.index, start.port, start.model_path, start.version, start.attempt
    url = f"http://{public_host(inf.host)}:{port}"
    log_path = paths.stage_logs(stage) / f"server-{index}.attempt_{attempt}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    adapter = None
    if is_adapter_dir(Path(model_path)) and not (Path(model_path) / "config.json").is_file():
        # A LoRA checkpoint (publish: adapter): the engine serves the base, then loads the adapter (`load_adapter`).
        adapter, model_path = (lora_adapter_name(version), str(Path(model_path).resolve())), config.model.path
    specs = server_procs(config, host=inf.host, port=port, model_path=model_path, version=version)
    procs: list[subprocess.Popen[bytes]] = []
    handles: list[IO[bytes]] = []
    for spec in specs:
        path = (
            log_path
            if spec.log_suffix is None
            else log_path.with_name(f"server-{index}-{spec.log_suffix}.attempt_{attempt}.log")
        )
        handle = open(path, "ab")  # noqa: SIM115 - the child keeps writing to it; closed in _terminate
        handles.append(handle)
        procs.append(_spawn(dataclasses.replace(spec, env={**spec.env, **gpu_env(config, index)}), handle))
    entry = InferenceEntry(
        url=url,
        backend=inf.backend,
        model_path=adapter[1] if adapter else model_path,
        weight_version=version,
        host=socket.gethostname(),
        pid=procs[-1].pid,
        started_at=time.time(),
        tp_size=1 if inf.backend == "hf" else inf.tp_size,  # the hf engine has no tensor parallelism
        attempt=attempt,
    )
    log.info(
        "started %s server %d on port %d (pids %s, log %s)", inf.backend, index, port, [p.pid for p in procs], log_path
    )
    return RunningServer(
        name=f"{socket.gethostname()}-{port}",
        url=url,
        log_path=log_path,
        procs=procs,
        entry=entry,
        index=index,
        port=port,
        logs=handles,
        adapter=adapter,
    )


def _spawn(spec: ProcSpec, log_file: IO[bytes]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **spec.env}
    # start_new_session: a Ctrl-C in the terminal reaches only the supervisor, which stops children in order.
    # PDEATHSIG: if the supervisor itself is SIGKILLed (OOM killer, `arl stop` escalating, Slurm) the servers
    # must not live on holding their ports, GPU memory and stale registry entries.
    return subprocess.Popen(
        spec.argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (Linux): SIGKILL this process when its parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def wait_healthy(servers: list[RunningServer], timeout_s: float, stop: threading.Event) -> None:
    """Until every server answers `/health` (or `stop` is set); `ServerDied` or `WaitTimeout` naming it and its log."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=2.0) as http:
        while pending:
            for server in list(pending):
                code = server.exited()
                if code is not None:
                    raise ServerDied(
                        f"inference server {server.name} ({server.url}) exited with code {code} while "
                        f"starting; see its log: {server.log_path}\n{tail(server.log_path)}"
                    )
                if healthy(http, server.url):
                    pending.remove(server)
            if not pending or stop.is_set():
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{s.name} ({s.url}, log {s.log_path})" for s in pending)
                raise WaitTimeout(
                    f"timed out after {timeout_s:.0f}s waiting for inference servers to answer /health: "
                    f"{names}. Raise inference.startup_timeout_s if the model is large."
                )
            time.sleep(0.25)


def _install_signal_handlers(stop: threading.Event) -> Any:
    """SIGTERM/SIGINT set `stop` (handled in the loop, so cleanup runs); returns a function restoring them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]
