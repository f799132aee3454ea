"""Addresses across nodes: the route's source address, interfaces by name, the broadcast group's address,
and the servers' log of which hosts called them (real sockets and a real uvicorn server on loopback)."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest
from fastapi import FastAPI

from pipeline.engine.server.serve import serve_in_thread
from pipeline.net.addresses import PeerLog, interface_address, interface_of, public_host, route_source
from pipeline.trainer.publish.transports import group_address


def test_route_source_is_the_address_a_peer_reaches_us_on() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("localhost") == "127.0.0.1"


def test_interfaces_by_name_and_by_address() -> None:
    assert interface_address("lo") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: held by no interface here
    with pytest.raises(ValueError, match=r"no network interface .nope0. on .*it has: .*lo"):
        interface_address("nope0")


def test_group_address_prefers_the_configured_interface_then_the_route() -> None:
    local = ["http://127.0.0.1:30000", "http://localhost:30001"]
    assert group_address(local, None) == "127.0.0.1"
    assert group_address(local, "lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="nope0"):
        group_address(local, "nope0")


def test_a_server_bound_to_every_interface_is_announced_by_host_name() -> None:
    assert public_host("0.0.0.0") == socket.gethostname()
    assert public_host("10.1.2.3") == "10.1.2.3"


def test_peer_log_names_each_new_client_once(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    logger = logging.getLogger("arl.test.peers")
    app.add_middleware(PeerLog, logger=logger, what="test server")
    handle = serve_in_thread(app, None, host="127.0.0.1")
    try:
        with caplog.at_level(logging.INFO, logger="arl.test.peers"):
            for _ in range(3):
                assert httpx.get(f"{handle.url}/ping", timeout=10).json() == {"ok": "yes"}
    finally:
        handle.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "arl.test.peers"]
    assert lines == ["test server: first request from 127.0.0.1 (GET /ping)"]
