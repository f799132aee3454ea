"""Ports and host names for the engine's servers (the inference stage, the vLLM adapter, tests)."""

from __future__ import annotations

import socket


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
