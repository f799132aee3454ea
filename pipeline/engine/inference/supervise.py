"""The inference stage's watch over its servers: health, crashes, the trainer's take-out requests, recovery.

Once a second, for each server:
- the trainer asked to take it out (`state/quarantine/<server>.json`: it failed to update or verify
  a weight swap): deregister it at once, SIGKILL its processes (a stalled server ignores SIGTERM),
  restart it;
- its process exited: deregister, restart;
- it is restarting: register it when it answers `/health`; `routable` only if it serves the
  announced version, else it waits unroutable for the trainer's next publication (which includes
  it) and is made routable once it reports the announced version;
- else the health check: three failures in a row deregister it until it answers again.
A restart loads the newest complete checkpoint; each server restarts at most `inference.max_restarts`
times, then stays down. The stage exits 1 when no server is left running or restarting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from pipeline.engine.registry import remove_entry, write_entry
from pipeline.errors import ArlError
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import published_version
from schemas.engine_api import InferenceEntry

log = logging.getLogger("arl.engine.launch")
HEALTH_STRIKES = 3
POLL_S = 1.0


@dataclass
class RunningServer:
    name: str
    url: str
    log_path: Path
    procs: list[subprocess.Popen[bytes]]
    entry: InferenceEntry
    index: int = 0
    port: int = 0
    registered: bool = False
    strikes: int = 0
    restarts: int = 0
    starting_since: float | None = None
    """Monotonic time of a restart not yet answering `/health` (None: up, or never restarted)."""
    logs: list[IO[bytes]] = field(default_factory=list)
    adapter: tuple[str, str] | None = None
    """(name, directory) of the LoRA adapter it must load before it is registered: a checkpoint of a run with
    `trainer.lora.publish: adapter` is served as the base model + that adapter (`load_adapter`)."""

    def exited(self) -> int | None:
        """Exit code of the first process that ended, or None while all run."""
        for proc in self.procs:
            code = proc.poll()
            if code is not None:
                return code
        return None


Restart = Callable[[RunningServer], RunningServer]
"""Starts a fresh process for a server (same index and port) from the newest checkpoint."""


class Supervisor:
    def __init__(
        self,
        paths: RunPaths,
        servers: list[RunningServer],
        restart: Restart,
        *,
        max_restarts: int,
        startup_timeout_s: float,
    ) -> None:
        self.paths = paths
        self.live = list(servers)
        self.restart = restart
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s

    def run(self, stop: threading.Event) -> int:
        with httpx.Client(timeout=5.0) as http:
            while not stop.wait(POLL_S):
                for server in list(self.live):
                    self._watch(http, server)
                if not self.live:
                    log.error("every inference server has exited; stopping the stage")
                    return 1
        log.info("stop requested: deregistering and stopping %d server(s)", len(self.live))
        return 0

    def _watch(self, http: httpx.Client, server: RunningServer) -> None:
        request = self._take_out_request(server)
        code = server.exited()
        if request is not None:
            log.error(
                "the trainer took inference server %s (%s) out at version %s: %s",
                server.name,
                server.url,
                request.get("version"),
                request.get("reason"),
            )
            deregister(self.paths, server)
            kill(server)
            self._recover(server, "taken out by the trainer")
            with contextlib.suppress(FileNotFoundError):
                self.paths.quarantine_entry(server.name).unlink()
        elif code is not None:
            log.error(
                "inference server %s (%s) exited with code %s; deregistered. Its log: %s\n%s",
                server.name,
                server.url,
                code,
                server.log_path,
                tail(server.log_path),
            )
            deregister(self.paths, server)
            self._recover(server, f"exited with code {code}")
        elif server.starting_since is not None:
            self._starting(http, server)
        else:
            self._check(http, server)

    def _take_out_request(self, server: RunningServer) -> dict[str, object] | None:
        path = self.paths.quarantine_entry(server.name)
        try:
            request = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        # A request about an earlier life of this server (it was already restarted) is stale.
        if request.get("started_at") not in (None, server.entry.started_at):
            path.unlink(missing_ok=True)
            return None
        return request if isinstance(request, dict) else None

    def _recover(self, server: RunningServer, why: str) -> None:
        self.live.remove(server)
        close_logs(server)
        if server.restarts >= self.max_restarts:
            log.error(
                "inference server %s %s and was restarted %d time(s) already (inference.max_restarts); it stays down",
                server.name,
                why,
                server.restarts,
            )
            return
        fresh = self.restart(server)
        fresh.restarts = server.restarts + 1
        fresh.starting_since = time.monotonic()
        log.warning(
            "restarting inference server %s (%s; restart %d of %d) from %s, weight version %d",
            server.name,
            why,
            fresh.restarts,
            self.max_restarts,
            fresh.entry.model_path,
            fresh.entry.weight_version,
        )
        self.live.append(fresh)

    def _starting(self, http: httpx.Client, server: RunningServer) -> None:
        assert server.starting_since is not None
        if healthy(http, server.url):
            server.starting_since = None
            load_adapter(http, server)
            announced = published_version(self.paths)
            routable = server.entry.weight_version == announced
            server.entry = server.entry.model_copy(update={"routable": routable, "started_at": time.time()})
            register(self.paths, server)
            behind = f" (announced: {announced}): unroutable until the trainer updates it"
            log.info(
                "inference server %s is back at weight version %d%s",
                server.name,
                server.entry.weight_version,
                "" if routable else behind,
            )
        elif time.monotonic() - server.starting_since > self.startup_timeout_s:
            log.error(
                "restarted inference server %s did not answer /health within %.0fs (log %s)",
                server.name,
                self.startup_timeout_s,
                server.log_path,
            )
            kill(server)
            self._recover(server, "did not come back")

    def _check(self, http: httpx.Client, server: RunningServer) -> None:
        if healthy(http, server.url):
            if not server.registered:
                log.info("inference server %s answers again; re-registered", server.name)
                register(self.paths, server)
            server.strikes = 0
            if not server.entry.routable:
                self._promote(http, server)
            return
        server.strikes += 1
        if server.strikes == HEALTH_STRIKES and server.registered:
            log.error(
                "inference server %s failed %d health checks; deregistered (log: %s)",
                server.name,
                HEALTH_STRIKES,
                server.log_path,
            )
            deregister(self.paths, server)

    def _promote(self, http: httpx.Client, server: RunningServer) -> None:
        """Routable once it serves the announced version. The announcement is read before the take-out
        queue: the trainer queues a failed server before it announces, so a failed one is never promoted."""
        announced = published_version(self.paths)
        try:
            served = int(http.get(f"{server.url}/model_info").json().get("weight_version"))
        except (httpx.HTTPError, ValueError, TypeError):
            return
        if served == announced and not self.paths.quarantine_entry(server.name).exists():
            server.entry = server.entry.model_copy(update={"routable": True})
            register(self.paths, server)
            log.info("inference server %s verified weight version %d: routable again", server.name, served)


def healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def load_adapter(http: httpx.Client, server: RunningServer, timeout_s: float = 600.0) -> None:
    """Load the server's pending LoRA adapter (`RunningServer.adapter`) once it answers; an `ArlError` naming the
    server and the engine's reason if it refuses."""
    if server.adapter is None:
        return
    name, path = server.adapter
    answer = http.post(
        f"{server.url}/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=timeout_s
    )
    if answer.status_code != 200:
        raise ArlError(
            f"inference server {server.name} ({server.url}) refused LoRA adapter {name} from {path}: "
            f"{answer.status_code} {answer.text[:500]}"
        )
    server.adapter = None


def register(paths: RunPaths, server: RunningServer) -> None:
    write_entry(paths, server.name, server.entry)
    server.registered = True


def deregister(paths: RunPaths, server: RunningServer) -> None:
    if server.registered:
        remove_entry(paths, server.name)
        server.registered = False


def kill(server: RunningServer) -> None:
    """SIGKILL every process of the server and its children (each leads its own session)."""
    for proc in server.procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


def terminate(server: RunningServer, grace_s: float = 15.0) -> None:
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
    close_logs(server)


def close_logs(server: RunningServer) -> None:
    for handle in server.logs:
        if not handle.closed:
            handle.close()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"
