"""Session ends as events: the store announces every end once, whatever the cause, and an end call answers
only once its subscribers are done (the standalone proxy stage's spool is one). Exports in process wait
for calls in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.errors import ArlError
from pipeline.proxy.control import ProxyAPIError
from pipeline.proxy.errors import ApiError
from pipeline.proxy.local import LocalControl
from pipeline.proxy.sessions import SessionEnd, SessionStore
from pipeline.rollout.external import SpoolSubscriber
from pipeline.rollout.spool import Spool
from pipeline.run.config import validate_config
from pipeline.run.paths import RunPaths
from schemas.config import ProxyConfig


class SlowHook:
    """Stands in for export + spool write (the part under test is the store's ordering, not the disk)."""

    def __init__(self, fail: bool = False) -> None:
        self.release = asyncio.Event()
        self.seen: list[SessionEnd] = []
        self.fail = fail

    async def __call__(self, event: SessionEnd) -> None:
        await self.release.wait()
        if self.fail:
            raise OSError("disk full")
        self.seen.append(event)


def _store(hook: SlowHook | None = None, **proxy: float) -> SessionStore:
    store = SessionStore(ProxyConfig(**proxy), "admin-key")
    if hook is not None:
        store.on_end(hook)
    return store


async def test_a_repeated_end_call_waits_until_the_session_is_saved() -> None:
    hook = SlowHook()
    store = _store(hook)
    session = store.start("admin", None, {})
    first = asyncio.create_task(store.end(session, "end_session", "rejected"))
    second = asyncio.create_task(store.end(session, "end_session"))
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()  # neither may answer before the save
    hook.release.set()
    await asyncio.gather(first, second)
    assert hook.seen == [SessionEnd(session.id, "end_session", "rejected")], "announced once, with the first status"
    await store.end(session, "finalize")  # a late repeat of a saved session is a no-op
    assert len(hook.seen) == 1


async def test_a_failed_save_fails_every_end_call_of_the_session() -> None:
    hook = SlowHook(fail=True)
    store = _store(hook)
    session = store.start("admin", None, {})
    calls = [asyncio.create_task(store.end(session, "end_session")) for _ in range(2)]
    await asyncio.sleep(0.05)
    hook.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        assert isinstance(result, ApiError) and result.status == 503, results
        assert session.id in result.message and "could not save it" in result.message


async def test_an_idle_timeout_is_announced_like_an_end_call() -> None:
    hook = SlowHook()
    hook.release.set()
    store = _store(hook, session_timeout_s=10.0)
    idle, busy = store.start("admin", None, {}), store.start("admin", None, {})
    busy.inflight += 1  # a call in flight keeps a session open however long it takes
    ended, _ = await store.sweep(now=idle.last_active + 11.0)
    assert ended == [idle.id] and idle.ended == "timeout" and busy.ended is None
    assert hook.seen == [SessionEnd(idle.id, "timeout", "ok")]


async def test_an_unknown_run_status_counts_as_ok() -> None:
    hook = SlowHook()
    hook.release.set()
    store = _store(hook)
    session = store.start("admin", None, {})
    await store.end(session, "end_session", "weird")
    assert hook.seen == [SessionEnd(session.id, "end_session", "ok")]


async def test_an_in_process_export_waits_for_calls_in_flight() -> None:
    store = _store()
    control = LocalControl(store, export_wait_s=0.2)
    info = await control.start_session("g", {"index": 1})
    session = store.get(info.session_id)
    session.inflight += 1
    await control.end_session(info.session_id)
    with pytest.raises(ProxyAPIError, match=f"session {info.session_id} still has 1 call") as refused:
        await control.export(info.session_id, style="concat", discount=1.0)
    assert refused.value.status == 409

    control.export_wait_s = 30.0
    export = asyncio.create_task(control.export(info.session_id, style="concat", discount=1.0))
    await asyncio.sleep(0.05)
    assert not export.done()
    session.inflight -= 1  # the call finishes: the export goes ahead at once, no polling
    exported = await asyncio.wait_for(export, 1.0)
    assert exported.session_id == info.session_id and exported.group_id == "g" and exported.rows == []
    assert info.session_id not in store.sessions, "an exported session is forgotten"


async def test_a_spool_that_cannot_be_written_fails_the_end_call_and_stops_the_stage(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.proxy_spool.parent.mkdir(parents=True)
    paths.proxy_spool.write_text("a file where the spool directory belongs")
    config = validate_config({"fileroot": str(tmp_path / "runs"), "num_steps": 1, "model": {"path": "tiny"},
                              "rollout": {"source": "external", "batch_size": 1},
                              "proxy": {"client_keys": ["k"]}})  # fmt: skip
    store = _store()
    subscriber = SpoolSubscriber(Spool(paths), config)
    store.on_end(subscriber.subscribe(LocalControl(store)))
    session = store.start("client:0", None, {})
    with pytest.raises(ApiError) as refused:
        await store.end(session, "end_session")
    assert refused.value.status == 503 and session.id in refused.value.message
    assert subscriber.finished.empty() and subscriber.saving == 0
    with pytest.raises(ArlError, match="could not be exported and spooled"):
        subscriber.check()


async def test_the_open_count_follows_starts_ends_exports_and_expiry() -> None:
    store = _store(session_timeout_s=10.0, max_sessions=3)
    a, b, c = (store.start("admin", None, {}) for _ in range(3))
    with pytest.raises(ApiError) as full:
        store.start("admin", None, {})
    assert full.value.status == 429 and "max_sessions" in full.value.message
    await store.end(a, "end_session")
    store.export(a, "individual", 1.0)
    store.export(b, "individual", 1.0)  # an export ends the session too
    assert store.open_count() == 1 == sum(s.ended is None for s in store.sessions.values())
    await store.end(c, "end_session")
    await store.end(c, "finalize")  # a repeated end does not count twice
    assert store.open_count() == 0
    d = store.start("admin", None, {})
    await store.sweep(now=d.last_active + 10.0)  # idle: ended by the sweep
    assert store.open_count() == 0
    await store.sweep(now=d.last_active + 30.0)  # ended and unexported: dropped
    assert store.open_count() == 0 and not store.sessions
    store.start("admin", None, {})
    assert store.open_count() == 1
