"""Key checks of the proxy, done before anything reads the request body.

`KeyCheck` is a pure ASGI middleware: for every keyed path (`ROUTE_KEYS`) it identifies the
caller from `Authorization: Bearer` / `x-api-key` (`presented_key`, the one place a key is read
from a request; constant-time compares in
`SessionStore.identify`), answers 401 / 403 / 410 in the route's own error shape when the key
is missing, wrong or of the wrong kind, and otherwise leaves the `Caller` in the ASGI scope for
the route (`caller_of`). FastAPI decodes a JSON body before it runs a route's dependencies, so a
check done there would answer a keyless request with a bad body "400 not valid JSON"; here it
answers 401 whatever the body. Paths without a rule (`/health`, `/openapi.json`, unknown paths)
pass through untouched; `check_routes` (at start-up) makes sure no route is left out by mistake.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.proxy.errors import ApiError
from pipeline.proxy.http import send_error
from pipeline.proxy.sessions import Caller, KeyKind, SessionStore

ANY_KEY: tuple[KeyKind, ...] = ("admin", "client", "session")
# path -> the kinds of key it accepts (docs/proxy.md, "Keys"). Finer rules (a client key acts only on its own
# sessions, a session key only on itself) need the body and live in pipeline/proxy/rl.py.
ROUTE_KEYS: dict[str, tuple[KeyKind, ...]] = {
    "/v1/models": ANY_KEY,
    "/grant_capacity": ("admin",),
    "/rl/start_session": ("admin", "client"),
    "/v1/chat/completions": ("session",),
    "/v1/responses": ("session",),
    "/v1/messages": ("session",),
    "/rl/set_reward": ANY_KEY,
    "/rl/end_session": ANY_KEY,
    "/export_trajectories": ("admin",),
    "/rl/v1/set_reward": ("session",),
    "/rl/v1/finalize": ("session",),
}
PUBLIC_PATHS = frozenset({"/health"})
_SCOPE_KEY = "arl.caller"


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from `Authorization: Bearer <key>` or else `x-api-key: <key>` (Anthropic's header).

    Only the first of each header counts, as with Starlette's `Headers.get`.
    """
    auth: bytes | None = None
    api_key: bytes | None = None
    for name, value in headers:  # ASGI header names are lower-case
        if name == b"authorization" and auth is None:
            auth = value
        elif name == b"x-api-key" and api_key is None:
            api_key = value
    if auth:
        scheme, _, rest = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and rest.strip():
            return rest.strip()
    key = api_key.decode("latin-1").strip() if api_key else ""
    return key or None


def identify(store: SessionStore, scope: Scope, kinds: tuple[KeyKind, ...]) -> Caller:
    """The caller behind the request's key, if its kind is one of `kinds` (else 401/403/410)."""
    caller = store.identify(presented_key(scope.get("headers", [])))
    if caller.kind not in kinds:
        raise ApiError(403, f"this endpoint takes {' or '.join(kinds)} keys, not a {caller.kind} key")
    return caller


class KeyCheck:
    """Pure ASGI middleware: see the module docstring. `routes` is shared, so rules added later count."""

    def __init__(self, app: ASGIApp, store: SessionStore, routes: dict[str, tuple[KeyKind, ...]]) -> None:
        self.app = app
        self.store = store
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            kinds = self.routes.get(scope["path"])
            if kinds is not None:
                try:
                    scope[_SCOPE_KEY] = identify(self.store, scope, kinds)
                except ApiError as err:
                    await send_error(scope["path"], send, err)
                    return
        await self.app(scope, receive, send)


def note_refusal(request: Request, err: ApiError) -> None:
    """Keep the error a session's call was answered with on the session (`Session.last_refusal`)."""
    caller = request.scope.get(_SCOPE_KEY)
    if caller is not None and caller.session is not None:
        caller.session.last_refusal = f"{err.status}: {err.message}"


def caller_of(request: Request) -> Caller:
    """The caller `KeyCheck` identified for this request (a FastAPI dependency)."""
    caller = request.scope.get(_SCOPE_KEY)
    if caller is None:  # only a route missing from the key rules gets here; check_routes stops that at start
        raise RuntimeError(f"no key check ran for {request.url.path}: give it a key rule (ProxyServer.protect)")
    return caller


def check_routes(app: FastAPI, routes: dict[str, tuple[KeyKind, ...]]) -> None:
    """Every route is public or has a key rule: nothing is left open (or unusable) by accident."""
    paths = {route.path for route in app.routes if isinstance(route, Route)}
    unlisted = paths - PUBLIC_PATHS - {app.openapi_url} - routes.keys()
    if unlisted:
        raise RuntimeError(f"proxy routes without a key rule: {sorted(unlisted)} (add them with ProxyServer.protect)")
