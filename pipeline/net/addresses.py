"""Ports, host names and addresses: the engine's servers, the proxy, the weight broadcast across nodes."""

from __future__ import annotations

import logging
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it; another process may take it before we bind)."""
    with socket.socket() as sock:
        sock.bind((_bindable(host), 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((_bindable(host), port))
        except OSError:
            return False
    return True


def public_host(host: str) -> str:
    """The host other nodes use to reach a server bound to `host`."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host


def _bindable(host: str) -> str:
    # An IPv4 socket cannot bind "::" or ""; both mean "every interface", as "0.0.0.0" does.
    return host if host not in ("", "::") else "0.0.0.0"


def route_source(host: str) -> str:
    """Our address on the route to `host`: the one `host` can reach us back on (no packet is sent).

    Unlike the address the machine's own name resolves to, this is never a loopback alias such as
    Debian's `127.0.1.1` when `host` is another node.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(host), 9))  # a UDP "connect" only picks the route
        return str(sock.getsockname()[0])


def interface_address(ifname: str) -> str:
    """The IPv4 address of the network interface `ifname` (e.g. `ib0`); a clear error when it has none."""
    import psutil

    addrs = psutil.net_if_addrs()
    if ifname not in addrs:
        have = ", ".join(sorted(addrs))
        raise ValueError(f"no network interface {ifname!r} on {socket.gethostname()} (it has: {have})")
    for addr in addrs[ifname]:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise ValueError(f"network interface {ifname!r} on {socket.gethostname()} has no IPv4 address")


def interface_of(address: str) -> str | None:
    """The name of the interface holding the IPv4 `address`, if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return str(name)
    return None


class PeerLog:
    """ASGI middleware: logs the address of each new client once ("first request from 10.0.0.7").

    A server's log then says which hosts used it: on a cluster, where its callers really came from.
    """

    def __init__(self, app: Any, logger: logging.Logger, what: str) -> None:
        self.app = app
        self.logger = logger
        self.what = what
        self.seen: set[str] = set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        client = scope.get("client") if scope.get("type") == "http" else None
        if client and client[0] not in self.seen and len(self.seen) < 1024:
            self.seen.add(client[0])
            self.logger.info(
                "%s: first request from %s (%s %s)", self.what, client[0], scope.get("method"), scope.get("path")
            )
        await self.app(scope, receive, send)
