"""The `vllm` backend's gate without a vLLM server: holding requests, the `wait` pause's deadline, aborts.

The paths tested here make no upstream call (no request is frozen, nothing is aborted in bulk); those that
do run against a real vLLM in tests/integration/test_vllm_interrupt.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pipeline.engine.server.requests import RequestError
from pipeline.engine.server.vllm.gate import Gate


def gate(drain_timeout_s: float = 3600.0) -> Gate:
    return Gate(httpx.AsyncClient(base_url="http://127.0.0.1:9"), version=3, drain_timeout_s=drain_timeout_s)


async def test_wait_pause_fails_past_its_deadline_naming_what_still_runs() -> None:
    g = gate(drain_timeout_s=0.05)
    never = asyncio.get_running_loop().create_future()
    g.inflight["r1"] = never
    with pytest.raises(RequestError, match=r"paused \(mode wait\): 1 requests still run after 0.05 s"):
        await g.pause("wait")
    assert not g.open.is_set()  # new requests stay held: the caller decides (continue, or another mode)
    never.cancel()


async def test_wait_pause_answers_once_the_requests_in_flight_are_done_and_holds_new_ones() -> None:
    g = gate()
    finishing = asyncio.get_running_loop().create_future()
    g.inflight["r1"] = finishing
    pausing = asyncio.create_task(g.pause("wait"))
    await asyncio.sleep(0.05)
    assert not pausing.done()
    g.done("r1")
    assert "no request in flight" in await pausing
    held = asyncio.create_task(g.admit(probe=False))
    await g.admit(probe=True)  # the trainer's probe runs while paused (vLLM is not frozen)
    await asyncio.sleep(0.05)
    assert not held.done()
    await g.resume()
    await held


async def test_an_abort_between_two_upstream_calls_ends_the_next_one() -> None:
    """A streamed request is aborted while its last chunk is being handed on (nothing upstream is pending):
    its next upstream call is cancelled before it runs, and the gate tells an abort from a client gone away."""
    g = gate()
    await g.upstream("r1", asyncio.sleep(0, result="chunk"))
    assert g.abort("r1") == 1
    with pytest.raises(asyncio.CancelledError):
        await g.upstream("r1", asyncio.sleep(3600))
    assert g.was_aborted("r1")
    g.done("r1")
    assert not g.inflight and not g.was_aborted("r1")


async def test_a_version_loaded_with_nothing_frozen_labels_tokens_at_once() -> None:
    g = gate()
    g.set_version(None)
    assert (g.served_version, g.sampling_version) == (3, 3)
    g.set_version(4)
    assert (g.served_version, g.sampling_version) == (4, 4)
