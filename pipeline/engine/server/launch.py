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
5. supervise: a server whose process exits is logged and deregistered; a server failing three
   health checks in a row is deregistered until it answers again; when none is left, exit 1;
6. on SIGTERM / SIGINT: deregister everything first, then stop the processes (by pid).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from pipeline.engine.net import free_port, port_is_free, public_host
from pipeline.engine.registry import remove_entry, write_entry
from pipeline.engine.server.procs import ProcSpec, server_procs
from pipeline.errors import ArlError, WaitTimeout
from pipeline.paths import RunPaths
from pipeline.stage import StageContext
from schemas.config import ArlConfig
from schemas.engine_api import InferenceEntry

log = logging.getLogger("arl.engine.launch")
_HEALTH_STRIKES = 3
_POLL_S = 1.0


class ServerDied(ArlError):
    """An inference server process exited while the stage was starting it."""


@dataclass
class RunningServer:
    name: str
    url: str
    log_path: Path
    procs: list[subprocess.Popen[bytes]]
    entry: InferenceEntry
    registered: bool = False
    strikes: int = 0
    logs: list[IO[bytes]] = field(default_factory=list)

    def exited(self) -> int | None:
        """Exit code of the first process that ended, or None while all run."""
        for proc in self.procs:
            code = proc.poll()
            if code is not None:
                return code
        return None


def initial_weights(paths: RunPaths, config: ArlConfig) -> tuple[str, int]:
    """(model dir, version) to serve first: the newest complete checkpoint, else the initial model."""
    versions = paths.complete_checkpoints()
    if versions:
        return str(paths.checkpoint_dir(versions[-1])), versions[-1]
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
    try:
        for index, port in enumerate(_ports(config)):
            servers.append(_start(paths, config, index, port, model_path, version, attempt))
        _wait_healthy(servers, config.inference.startup_timeout_s, stop)
        for server in servers:
            _register(paths, server)
        log.info("inference servers ready: %s", ", ".join(s.url for s in servers))
        return _supervise(paths, servers, stop)
    finally:
        for server in servers:
            _deregister(paths, server)
        for server in servers:
            _terminate(server)
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


def _start(
    paths: RunPaths, config: ArlConfig, index: int, port: int, model_path: str, version: int, attempt: int
) -> RunningServer:
    inf = config.inference
    url = f"http://{public_host(inf.host)}:{port}"
    log_path = paths.stage_logs("inference") / f"server-{index}.attempt_{attempt}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
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
        procs.append(_spawn(spec, handle))
    entry = InferenceEntry(
        url=url,
        backend=inf.backend,
        model_path=model_path,
        weight_version=version,
        host=socket.gethostname(),
        pid=procs[-1].pid,
        started_at=time.time(),
        tp_size=1 if inf.backend == "hf" else inf.tp_size,  # the hf engine has no tensor parallelism
    )
    log.info(
        "started %s server %d on port %d (pids %s, log %s)", inf.backend, index, port, [p.pid for p in procs], log_path
    )
    return RunningServer(f"{socket.gethostname()}-{port}", url, log_path, procs, entry, logs=handles)


def _spawn(spec: ProcSpec, log_file: IO[bytes]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **spec.env}
    # start_new_session: a Ctrl-C in the terminal reaches only the supervisor, which stops children in order.
    # PDEATHSIG: if the supervisor itself is SIGKILLed (OOM killer, `arl stop` escalating, Slurm) the servers
    # must not live on holding their ports, GPU memory and stale registry entries.
    return subprocess.Popen(spec.argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent)  # fmt: skip


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (Linux): SIGKILL this process when its parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _wait_healthy(servers: list[RunningServer], timeout_s: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=2.0) as http:
        while pending:
            for server in list(pending):
                code = server.exited()
                if code is not None:
                    raise ServerDied(
                        f"inference server {server.name} ({server.url}) exited with code {code} while "
                        f"starting; see its log: {server.log_path}\n{_tail(server.log_path)}"
                    )
                if _healthy(http, server.url):
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


def _supervise(paths: RunPaths, servers: list[RunningServer], stop: threading.Event) -> int:
    live = list(servers)
    with httpx.Client(timeout=5.0) as http:
        while not stop.wait(_POLL_S):
            for server in list(live):
                code = server.exited()
                if code is not None:
                    log.error(
                        "inference server %s (%s) exited with code %s; deregistered. Its log: %s\n%s",
                        server.name,
                        server.url,
                        code,
                        server.log_path,
                        _tail(server.log_path),
                    )
                    _deregister(paths, server)
                    live.remove(server)
                    continue
                _check(paths, http, server)
            if not live:
                log.error("every inference server has exited; stopping the stage")
                return 1
    log.info("stop requested: deregistering and stopping %d server(s)", len(live))
    return 0


def _check(paths: RunPaths, http: httpx.Client, server: RunningServer) -> None:
    if _healthy(http, server.url):
        if not server.registered:
            log.info("inference server %s answers again; re-registered", server.name)
            _register(paths, server)
        server.strikes = 0
        return
    server.strikes += 1
    if server.strikes == _HEALTH_STRIKES and server.registered:
        log.error(
            "inference server %s failed %d health checks; deregistered (log: %s)",
            server.name,
            _HEALTH_STRIKES,
            server.log_path,
        )
        _deregister(paths, server)


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _register(paths: RunPaths, server: RunningServer) -> None:
    write_entry(paths, server.name, server.entry)
    server.registered = True


def _deregister(paths: RunPaths, server: RunningServer) -> None:
    if server.registered:
        remove_entry(paths, server.name)
        server.registered = False


def _terminate(server: RunningServer, grace_s: float = 15.0) -> None:
    """SIGTERM each process of the server (by pid), SIGKILL what is left after `grace_s`."""
    for proc in reversed(server.procs):  # adapters before the engines they front
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in server.procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("server process %d ignored SIGTERM for %.0fs; killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()
    for handle in server.logs:
        handle.close()


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


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"
