"""The standalone proxy's session ledger: an end call answers only once its session is saved."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.rollout.external import SessionLedger


class SlowRecorder:
    """Stands in for export + spool write (the part under test is the ledger's ordering, not the disk)."""

    def __init__(self, fail: bool = False) -> None:
        self.release = asyncio.Event()
        self.saved: list[str] = []
        self.fail = fail

    async def __call__(self, session_id: str, status: str) -> str:
        await self.release.wait()
        if self.fail:
            raise OSError("disk full")
        self.saved.append(session_id)
        return session_id


async def _ledger(recorder: SlowRecorder) -> SessionLedger:
    ledger = SessionLedger()
    ledger.started("s1", "key-1")
    ledger.recorder = recorder  # type: ignore[assignment]
    ledger.ready.set()
    return ledger


async def test_a_repeated_end_call_waits_until_the_session_is_saved() -> None:
    recorder = SlowRecorder()
    ledger = await _ledger(recorder)
    first = asyncio.create_task(ledger.finish("s1", "ok"))
    second = asyncio.create_task(ledger.finish("s1", "ok"))
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()  # neither may answer before the save
    recorder.release.set()
    await asyncio.gather(first, second)
    assert recorder.saved == ["s1"] and ledger.finished.qsize() == 1 and not ledger.saving
    await ledger.finish("s1", "ok")  # a late repeat of a saved session is a no-op
    assert ledger.finished.qsize() == 1


async def test_a_failed_save_fails_every_end_call_of_the_session() -> None:
    recorder = SlowRecorder(fail=True)
    ledger = await _ledger(recorder)
    calls = [asyncio.create_task(ledger.finish("s1", "ok")) for _ in range(2)]
    await asyncio.sleep(0.05)
    recorder.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results), results
    assert ledger.finished.empty()
    with pytest.raises(Exception, match="could not be exported and spooled"):
        ledger.check()
