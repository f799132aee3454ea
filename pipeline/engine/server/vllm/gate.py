"""The `vllm` backend's gate: which requests may go to vLLM now, what a pause or a weight update does to
the requests in flight, and which weight version the tokens arriving now come from.

Pause modes (`/pause_generation`):

* `abort`: new requests are held, those in flight are aborted (their upstream calls are cancelled and
  vLLM's `/abort_requests` aborts every request it holds);
* `wait`: new requests are held; the pause answers once no request is in flight (they finish under the
  weights they started with), or fails after `drain_timeout_s`;
* `retract` and `in_place`: new requests are held and vLLM is paused with `POST /pause?mode=keep`: the
  requests in flight stop where they are and continue after `/continue_generation` (`POST /resume`),
  under whatever weights were loaded meanwhile. `in_place` passes `clear_cache=false`: vLLM keeps their
  KV cache, computed by the old weights. `retract` passes `clear_cache=true`: vLLM preempts every running
  request (its KV blocks are freed, `num_computed_tokens` goes back to 0) and resets the prefix cache, so
  after the resume each one is prefilled again from its prompt and the tokens it sampled, by the new
  weights: SGLang's retract. (vLLM 0.32's docstring of `/pause` says `clear_cache` is ignored with `keep`;
  its engine core applies it, and `tests/integration/test_vllm_interrupt.py` measures both: after the
  swap, `retract` equals a teacher-forced pass of the new weights, `in_place` one over the old KV.)

While vLLM is paused with `keep` it schedules nothing, so the trainer's verification probe cannot run:
it is held until the resume, and `/server_info` says `scores_while_paused: false` (the publisher resumes
such a server first and verifies it right after, as it does SGLang).

Weight updates never run a forward pass half-way: a disk update (`swapping`) and a broadcast session
(`begin_update` ... `end_update`) hold new requests and, unless vLLM holds the requests in flight frozen,
wait for those to finish first (`abort_all` aborts them instead). Frozen requests are not waited for (they
would never finish): the weights are swapped under them, and they continue after the resume. vLLM is never
resumed during an update (a broadcast session has its layers on the meta device until its end).

Per-token versions: the adapter streams from vLLM and labels each token with `sampling_version` when its
chunk arrives. Outside a `keep` pause an update runs with nothing in flight, so `sampling_version` moves
with the served version and every label is exact. During a `keep` pause nothing is sampled; the label moves
to the new version just before vLLM is resumed, so a token sampled before the pause is labelled the old
version unless its chunk reaches the adapter only after the whole pause (swap, verification and resume):
the one inexact case, which needs a stream to lag by that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pipeline.engine.server.requests import RequestError

FREEZE_MODES = ("retract", "in_place")
"""Pause modes that freeze the requests in flight inside vLLM (`/pause?mode=keep`)."""
DRAIN_TIMEOUT_S = 3600.0  # a `wait` pause outlasts the longest completion; the caller has its own deadline


class Gate:
    """The requests in flight to vLLM and the pause / update state around them (see the module docstring)."""

    def __init__(self, http: httpx.AsyncClient, version: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.http = http
        self.drain_timeout_s = drain_timeout_s
        self.served_version = version
        """The version of the weights loaded in vLLM (`weight_version` of the model info)."""
        self.sampling_version = version
        """The version that sampled the tokens arriving now (moves at the resume after a `keep` pause)."""
        self.open = _set_event()
        """New requests may go to vLLM."""
        self.steady = _set_event()
        """No weight update runs."""
        self.thawed = _set_event()
        """vLLM schedules requests (it is not paused with `keep`)."""
        self.paused: str | None = None
        """The mode of the pause in force (`/pause_generation` until `/continue_generation`)."""
        self.frozen: str | None = None
        """`retract` / `in_place` while vLLM holds the requests in flight frozen (`/pause?mode=keep`)."""
        self.updating = False
        """A broadcast session is open: requests are held whatever `/continue_generation` says."""
        self.inflight: dict[str, asyncio.Future[Any]] = {}
        """The upstream call each request in flight awaits now (cancelled to abort it)."""
        self.aborted: set[str] = set()

    # -- requests ---------------------------------------------------------------------------
    async def admit(self, *, probe: bool) -> None:
        """Wait until a request may go to vLLM. The verification probe runs while paused, but never during a
        weight update nor while vLLM is paused with `keep` (it would wait there for the resume)."""
        events = (self.steady, self.thawed) if probe else (self.open,)
        while not all(e.is_set() for e in events):  # another task may clear one between the wake-up and here
            await next(e for e in events if not e.is_set()).wait()

    async def upstream(self, rid: str, call: Any) -> Any:
        """Await one upstream call of request `rid`, abortably (`abort` cancels it)."""
        future = asyncio.ensure_future(call)
        self.inflight[rid] = future
        if rid in self.aborted:  # aborted between two calls (while its last chunk was being handed on)
            future.cancel()
        return await future

    def done(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        self.aborted.discard(rid)

    def was_aborted(self, rid: str) -> bool:
        """The last upstream call was cancelled by `abort` (not by the client going away)."""
        task = asyncio.current_task()
        return rid in self.aborted and not (task is not None and task.cancelling())

    def abort(self, rid: str | None) -> int:
        """Abort request `rid` (and its samples `<rid>_<i>`), or every one if None; returns how many.

        Cancelling the upstream call closes its connection, which makes vLLM abort the request soon after."""
        rids = [r for r in self.inflight if rid is None or r == rid or r.startswith(f"{rid}_")]
        for r in rids:
            self.aborted.add(r)
            self.inflight[r].cancel()
        return len(rids)

    async def abort_all(self) -> int:
        """Abort every request, and have vLLM abort them before this returns (`/abort_requests` with no ids:
        every request it tracks; the adapter is its one client), so a weight update after it finds none."""
        aborted = self.abort(None)
        _check(await self.http.post("/abort_requests", json={}), "/abort_requests")
        return aborted

    # -- pause ------------------------------------------------------------------------------
    async def pause(self, mode: str) -> str:
        self.paused = mode
        self.open.clear()
        if mode in FREEZE_MODES:
            await self._freeze(mode)
            return f"generation paused (mode {mode}): {len(self.inflight)} requests frozen in vLLM, new ones held"
        if mode == "abort":
            aborted = await self.abort_all()
            await self._settle()
            return f"generation paused (mode abort): {aborted} requests aborted, new ones held"
        if self.frozen and not self.steady.is_set():
            raise RequestError(
                f"cannot pause with mode wait: requests are frozen ({self.frozen}) under a weight "
                "update; end the update, then pause again"
            )
        await self._settle()  # requests frozen by an earlier pause run on to their end
        await self._drain("paused (mode wait)")
        return "generation paused (mode wait): no request in flight, new ones held"

    async def resume(self) -> None:
        self.paused = None
        await self._settle()
        self._reopen()

    # -- weight updates ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def swapping(self, abort_all: bool) -> AsyncIterator[None]:
        """A disk update runs inside: nothing runs a forward pass (held, aborted, drained or frozen)."""
        self.steady.clear()
        self.open.clear()
        try:
            if abort_all:
                await self.abort_all()
            if not self.frozen:
                await self._drain("weight update")
            yield
        finally:
            self.steady.set()
            await self._settle()
            self._reopen()

    async def begin_update(self) -> None:
        """A broadcast session opens: held from now until `end_update`, the requests in flight drained
        unless frozen."""
        self.updating = True
        self.steady.clear()
        self.open.clear()
        try:
            if not self.frozen:
                await self._drain("weight update session")
        except BaseException:
            await self.end_update()
            raise

    async def end_update(self) -> None:
        self.updating = False
        self.steady.set()
        await self._settle()
        self._reopen()

    def set_version(self, version: int | None) -> None:
        """The weights just loaded are `version` (None: the version stays)."""
        if version is None:
            return
        self.served_version = version
        if not self.frozen:  # nothing in flight: tokens from now on are the new version's
            self.sampling_version = version

    # -- internals --------------------------------------------------------------------------
    async def _freeze(self, mode: str) -> None:
        clear = "true" if mode == "retract" else "false"
        resp = await self.http.post("/pause", params={"mode": "keep", "clear_cache": clear})
        _check(resp, f"/pause?mode=keep&clear_cache={clear}")
        self.frozen = mode
        self.thawed.clear()

    async def _settle(self) -> None:
        """Resume vLLM if it is frozen and nothing keeps it so (a `keep` pause in force, an update running)."""
        if not self.frozen or self.paused in FREEZE_MODES or self.updating or not self.steady.is_set():
            return
        self.sampling_version = self.served_version  # before the resume: no new token can carry the old label
        _check(await self.http.post("/resume"), "/resume")
        self.frozen = None
        self.thawed.set()

    def _reopen(self) -> None:
        if self.paused is None and not self.updating and self.steady.is_set():
            self.open.set()

    async def _drain(self, what: str) -> None:
        """Wait until no request is in flight (new ones are held), at most `drain_timeout_s`."""
        deadline = time.monotonic() + self.drain_timeout_s
        while self.inflight:
            if time.monotonic() > deadline:
                raise RequestError(
                    f"{what}: {len(self.inflight)} requests still run after {self.drain_timeout_s:g} s "
                    "(new ones are held); /continue_generation, or pause with mode abort, retract or in_place"
                )
            await asyncio.sleep(0.01)


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def _check(resp: httpx.Response, what: str) -> None:
    if resp.status_code >= 400:
        raise RuntimeError(f"vLLM {what} failed ({resp.status_code}): {resp.text[:2000]}")
