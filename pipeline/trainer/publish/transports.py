"""How a weight version reaches a set of servers: a disk reload, or a bucketed broadcast over a group.

`publish.Publisher` decides who takes part and what happens after (verification, taking a server
out); a transport only moves the tensors and says, server by server, who got them (`Outcome`).
Every call has a deadline: each HTTP call `trainer.publish_timeout_s`, the group's setup and each
bucket's broadcast `trainer.broadcast_timeout_s` (the collective's own timeout, so a server that dies
or stalls mid-broadcast ends rank 0's wait with an error instead of a hang).

A broadcast that failed is blamed on the servers that did not answer (dead: connection refused;
stalled: no answer within the deadline) or that refused what the others took; the group is torn
down on every side, rebuilt with the others, and the version sent again from its first bucket.
When nobody can be blamed (every server refused the same bucket) the fault is the trainer's own and
is raised. The group (`init_weight_group`, SGLang's protocol, docs/inference.md) has a fresh name
each time: torch keeps a group's name in a process until it is destroyed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.weight_group import broadcast_from_trainer, destroy_weight_group, dtype_name, init_weight_group
from pipeline.errors import ArlError
from pipeline.net.addresses import free_port, interface_address, route_source
from pipeline.run.handoff import read_json, write_json_atomic
from pipeline.run.paths import RunPaths

log = logging.getLogger("arl.trainer.publish")
T = TypeVar("T")
GROUP_NAME = "arl-weights"
"""Prefix of the broadcast group's name (each group gets a fresh suffix)."""
Bucket = dict[str, torch.Tensor]
Answer = dict[str, Any] | EngineError
_ATTEMPTS = 3  # sends of one version over rebuilt groups before the transport gives up
CONTROL_S = 30.0
"""Deadline of the calls a healthy server answers at once (pause, continue, session and group calls, server
info), when `trainer.publish_timeout_s` is longer: a stalled server is blamed within it, not after minutes."""


@dataclass
class Outcome:
    """Which servers (by URL) got the version, and why the others did not."""

    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class AsyncRunner:
    """An event loop in a daemon thread: lets blocking code (the broadcast) overlap async HTTP calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="arl-publish-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class ServerCalls:
    """One `EngineClient` on the runner's loop; every call is per server and bounded by `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.runner = AsyncRunner()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arl-publish")
        """Work that overlaps the transfer (the verifier's reference forward)."""
        self.client = EngineClient([], request_timeout_s=timeout_s, health_interval_s=0)
        self.client.admin_timeout_s = timeout_s
        self.runner.run(self.client.start(), timeout_s)

    def each(self, urls: list[str], method: str, path: str, body: Any = None) -> dict[str, Answer]:
        """`path` on every server at once: each one's answer or error, within `trainer.publish_timeout_s` for
        weight loads and the verification's calls, `CONTROL_S` for the others."""
        if not urls:
            return {}
        # A pause with mode `wait` answers once the longest request in flight has finished.
        slow = path in ("/update_weights_from_disk", "/generate", "/get_weights_by_name") or body == {"mode": "wait"}
        deadline = self.timeout_s if slow else min(self.timeout_s, CONTROL_S)
        return self.runner.run(self.client.call_each(urls, method, path, body, timeout_s=deadline), deadline + 30)

    def start(self, urls: list[str], method: str, path: str, body: Any) -> dict[str, concurrent.futures.Future[Any]]:
        """Start `path` on each server (its own future), for calls that must overlap the broadcast."""
        per_url = body if isinstance(body, dict) and set(body) == set(urls) else None
        return {
            u: self.runner.submit(self.client._admin(u, method, path, per_url[u] if per_url else body)) for u in urls
        }

    def settle(
        self, futures: dict[str, concurrent.futures.Future[Any]], timeout_s: float, what: str
    ) -> dict[str, Answer]:
        """Each started call's answer or error, waiting at most `timeout_s` in all: a server that has not
        answered by then is stalled (its call is cancelled)."""
        deadline = time.monotonic() + timeout_s
        answers: dict[str, Answer] = {}
        for url, future in futures.items():
            try:
                answers[url] = future.result(timeout=max(deadline - time.monotonic(), 0.1))
            except (TimeoutError, concurrent.futures.TimeoutError):
                future.cancel()
                answers[url] = EngineError(f"{url} did not {what} within {timeout_s:.0f}s (stalled?)", server=url)
            except EngineError as exc:
                answers[url] = exc
        return answers

    def failures(self, urls: list[str], method: str, path: str, body: Any = None) -> dict[str, str]:
        return {u: str(r) for u, r in self.each(urls, method, path, body).items() if isinstance(r, EngineError)}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        try:
            self.runner.run(self.client.close(), 30)
        finally:
            self.runner.close()


def all_refused(urls: list[str], failed: dict[str, str], errors: dict[str, Any]) -> bool:
    """Every server answered the same call with a 4xx: the request was wrong (the trainer's fault)."""
    return (
        bool(urls)
        and set(failed) == set(urls)
        and all(isinstance(errors.get(u), EngineError) and 400 <= (errors[u].status or 0) < 500 for u in urls)
    )


class DiskTransport:
    """Each server reloads the checkpoint directory the trainer wrote (`/update_weights_from_disk`)."""

    def __init__(self, calls: ServerCalls) -> None:
        self.calls = calls

    def send(self, version: int, urls: list[str], checkpoint: Path | None, parts: list[Bucket]) -> Outcome:
        if checkpoint is None:
            raise ValueError("disk weight sync needs a checkpoint for every version")
        body = {"model_path": str(checkpoint.resolve()), "weight_version": str(version)}
        answers = self.calls.each(urls, "POST", "/update_weights_from_disk", body)
        failed = {u: str(r) for u, r in answers.items() if isinstance(r, EngineError)}
        if all_refused(urls, failed, answers):
            raise ArlError(f"every server refused /update_weights_from_disk of version {version}: {failed}")
        return Outcome([u for u in urls if u not in failed], failed)

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class _Group:
    name: str
    members: list[str]
    handle: Any


class BroadcastTransport:
    """Bucketed broadcast over a group shared with the servers (gloo on CPU, nccl on GPU)."""

    def __init__(
        self,
        calls: ServerCalls,
        paths: RunPaths,
        broadcast_timeout_s: float,
        on_bucket: Callable[[int, int], None] | None = None,
        *,
        interface: str | None = None,
    ) -> None:
        self.calls = calls
        self.interface = interface
        """`cluster.network_interface`; None: the group's address is the one on the route to the servers."""
        self.paths = paths
        self.broadcast_timeout_s = broadcast_timeout_s
        self.on_bucket = on_bucket
        """Called with (version, bucket index) before each bucket is sent: a seam for fault-injection tests."""
        self.group: _Group | None = None
        self.stale = _previous_group(paths)
        """The group of the trainer that ran before this one: left first, which makes a server drop what it
        staged from a broadcast that trainer never finished (an `/end_weight_update` would apply it)."""
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")

    def send(self, version: int, urls: list[str], checkpoint: Path | None, parts: list[Bucket]) -> Outcome:
        """Send `parts` to `urls` in one weight-update session; on a fault blame, rebuild and resend."""
        outcome = Outcome()
        live = list(urls)
        for _attempt in range(_ATTEMPTS):
            if not live:
                break
            blamed = self._session(version, live, parts)  # on a fault the group is torn down without the blamed
            if blamed is None:
                outcome.ok = live
                return outcome
            outcome.failed.update(blamed)
            live = [u for u in live if u not in blamed]
            log.warning("version %d: broadcast failed on %s; resending to %s", version, sorted(blamed), live)
        outcome.failed.update({u: "the broadcast failed on every attempt" for u in live})
        return outcome

    def _session(self, version: int, urls: list[str], parts: list[Bucket]) -> dict[str, str] | None:
        """One try: (re)build the group, begin, buckets, end. None on success, else the servers to blame."""
        if self.group is None or sorted(self.group.members) != sorted(urls):
            self._teardown()
            blamed = self._setup(urls)
            if blamed:
                return blamed
        if self.stale:
            self.calls.each(urls, "POST", "/destroy_weights_update_group", {"group_name": self.stale})
            self.stale = None
        # A session left open by a trainer that died mid-update would refuse our begin: close it first.
        self.calls.each(urls, "POST", "/end_weight_update", {})
        blamed = self.calls.failures(urls, "POST", "/begin_weight_update", {})
        if blamed:
            self._teardown(blamed)
            return blamed
        for i, bucket in enumerate(parts):
            if self.on_bucket is not None:
                self.on_bucket(version, i)
            blamed = self._bucket(bucket, version if i == len(parts) - 1 else None, urls, f"{i + 1}/{len(parts)}")
            if blamed:
                self._teardown(blamed)
                return blamed
        blamed = self.calls.failures(urls, "POST", "/end_weight_update", {})
        if blamed:
            self._teardown(blamed)
        return blamed or None

    def _setup(self, urls: list[str]) -> dict[str, str]:
        """Join as rank 0 while every server joins through `/init_weights_update_group`; {} when all joined."""
        info = self.calls.each(urls, "GET", "/server_info")
        blamed = {u: f"/server_info: {r}" for u, r in info.items() if isinstance(r, EngineError)}
        if blamed:
            return blamed
        sizes = {u: int(r.get("tp_size", 1) or 1) for u, r in info.items() if isinstance(r, dict)}
        world = 1 + sum(sizes.values())
        address = group_address(urls, self.interface)
        port = free_port("0.0.0.0")  # the store listens on every interface: the port must be free on all
        name = f"{GROUP_NAME}-{uuid.uuid4().hex[:8]}"
        write_json_atomic(
            self.paths.weight_sync,
            {
                "master_address": address,
                "master_port": port,
                "group_name": name,
                "backend": self.backend,
                "world_size": world,
                "created_at": time.time(),
            },
        )
        bodies, rank = {}, 1
        for url in urls:
            bodies[url] = {
                "master_address": address,
                "master_port": port,
                "rank_offset": rank,
                "world_size": world,
                "group_name": name,
                "backend": self.backend,
            }
            rank += sizes[url]
        joined = self.calls.start(urls, "POST", "/init_weights_update_group", bodies)
        try:
            handle = init_weight_group(
                address,
                port,
                rank=0,
                world_size=world,
                group_name=name,
                backend=self.backend,
                timeout_s=self.broadcast_timeout_s,
            )
        except Exception as exc:  # the rendezvous deadline passed: someone did not join
            answers = self.calls.settle(joined, self.broadcast_timeout_s, f"join weight group {name}")
            blamed = {u: str(r) for u, r in answers.items() if isinstance(r, EngineError) and r.status is None}
            return blamed or {
                u: f"did not join weight group {name} within {self.broadcast_timeout_s:.0f}s: {exc}" for u in urls
            }
        answers = self.calls.settle(joined, self.broadcast_timeout_s, f"join weight group {name}")
        self.group = _Group(name, list(urls), handle)
        blamed = {u: f"/init_weights_update_group: {r}" for u, r in answers.items() if isinstance(r, EngineError)}
        if blamed:
            self._teardown(blamed)
            return blamed
        log.info("weight broadcast group %s ready: %s world %d at %s:%d", name, self.backend, world, address, port)
        return {}

    def _bucket(
        self, bucket: dict[str, torch.Tensor], announce: int | None, urls: list[str], which: str
    ) -> dict[str, str]:
        """One bucket: every server's receive (HTTP) overlapping rank 0's broadcast; {} when all confirmed."""
        assert self.group is not None
        body: dict[str, Any] = {
            "names": list(bucket),
            "dtypes": [dtype_name(t.dtype) for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()],
            "group_name": self.group.name,
            "flush_cache": announce is not None,
        }
        if announce is not None:
            body["weight_version"] = str(announce)
        pending = self.calls.start(urls, "POST", "/update_weights_from_distributed", body)
        sent_error: Exception | None = None
        try:
            broadcast_from_trainer(self.group.handle, [t.to(self.device) for t in bucket.values()])
        except Exception as exc:  # the collective's deadline, or a peer that went away
            sent_error = exc
        answers = self.calls.settle(pending, self.broadcast_timeout_s, f"confirm bucket {which}")
        failed = {u: f"bucket {which}: {r}" for u, r in answers.items() if isinstance(r, EngineError)}
        if not failed and sent_error is None:
            return {}
        if all_refused(urls, failed, answers):
            raise ArlError(
                f"every server refused bucket {which} of the broadcast: {failed}"
                + (f" (rank 0: {sent_error})" if sent_error else "")
            )
        unreachable = {u: m for u, m in failed.items() if getattr(answers[u], "status", None) is None}
        # With a broken collective the servers that answered 400 are its victims; blame the silent ones.
        blamed = unreachable if sent_error is not None and unreachable else failed
        return blamed or {u: f"bucket {which}: rank 0's broadcast failed: {sent_error}" for u in urls}

    def _teardown(self, blamed: dict[str, str] | None = None) -> None:
        """Leave the group on every side but the blamed servers' (dead or stalled: they are being taken out, and a
        stalled one would hold the call until its deadline); the servers that leave drop what it staged."""
        if self.group is None:
            return
        group, self.group = self.group, None
        members = [u for u in group.members if u not in (blamed or {})]
        failed = self.calls.failures(members, "POST", "/destroy_weights_update_group", {"group_name": group.name})
        for url, why in failed.items():
            log.warning("%s did not leave weight group %s: %s", url, group.name, why)
        destroy_weight_group(group.handle)

    @property
    def group_name(self) -> str:
        return self.group.name if self.group is not None else ""

    def close(self) -> None:
        self._teardown()


def _previous_group(paths: RunPaths) -> str | None:
    try:
        record = read_json(paths.weight_sync)
    except (FileNotFoundError, ValueError):  # none yet, or a torn hand edit: no group to leave
        return None
    return str(record.get("group_name") or "") or None


def group_address(urls: list[str], interface: str | None) -> str:
    """The address the servers dial to join the trainer's group (rank 0 hosts its store).

    The configured interface's address; else loopback when every server is local; else our address on
    the route to the first remote server. Not the address our host name resolves to: on many machines
    that is a loopback alias (Debian's `127.0.1.1`), which a server on another node cannot reach.
    """
    if interface:
        return interface_address(interface)
    remote = [host for host in (urlparse(u).hostname or "" for u in urls) if host not in _LOOPBACK]
    return route_source(remote[0]) if remote else "127.0.0.1"


_LOOPBACK = ("127.0.0.1", "localhost", "::1")
