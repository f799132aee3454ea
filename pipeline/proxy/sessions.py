"""Sessions: keys, capacity, idle timeouts and each session's conversation tree.

Keys. The admin key and the client keys come from the config; a session key is minted at
`/rl/start_session` as `arl-sess-<session id>-<secret>`. Looking a session up by the id part
and comparing the secret with `hmac.compare_digest` keeps the check constant-time without
scanning every session. Keys are never logged and never echoed in an error.

Lifecycle. open -> ended (by `/rl/end_session`, `/rl/v1/finalize`, or `session_timeout_s` of
idleness with no call in flight) -> removed (after a successful export, or after another
`session_timeout_s` unexported). Calls on an ended or removed session answer 410; a small
tombstone table remembers removed ids for that.

End events. Whatever ends a session (an end call, finalize, the idle timeout), the store announces
it once to its subscribers (`on_end`): each gets a `SessionEnd` and is awaited. The end call answers
only once they are done (a repeated end call waits for the same announcement), and a subscriber that
raises turns the end call into a 503 naming the session. The standalone proxy stage subscribes its
durable spool this way (docs/rollout.md). A session exported while still open is taken whole by the
exporter and announces nothing.

Parent matching (docs/proxy.md, "Token-exact multi-turn"). A request's parent is the latest
interaction whose request messages + returned assistant message are a prefix of the new request's
messages (compared by `messages.message_key`) and whose tools are the same: the prompt is then
extended token-exactly.
Failing that, the interaction sharing the longest message prefix with the request (at least one
message) becomes the parent with a *prefix break* (the agent edited its history): the prompt is
re-rendered in full and concat export starts a new row there. No shared message -> a new root.
A request identical to an earlier one (a retry, or one of `n` choices) is that one's sibling.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.proxy.capacity import Capacity
from pipeline.proxy.control import RUN_STATUSES, ExportedSession
from pipeline.proxy.errors import ApiError
from pipeline.proxy.messages import MessageKey, common_prefix_len, prefix_hashes
from pipeline.proxy.trajectory import ExportStyle, Interaction, SessionTree, TrajectoryError
from schemas.api.rl import SamplingOverride
from schemas.config.proxy import ProxyConfig

log = logging.getLogger("arl.proxy.sessions")

SESSION_KEY_PREFIX = "arl-sess-"
_ID_LEN = 16
_TOMBSTONES = 100_000

KeyKind = Literal["admin", "client", "session"]


def worker_of(session_id: str) -> int | None:
    """The pool worker that minted `session_id` (its first two hex digits; see `SessionStore`), None if malformed.
    Only meaningful in a pool: a single proxy's ids are random throughout."""
    try:
        return int(session_id[:2], 16) if len(session_id) == _ID_LEN else None
    except ValueError:
        return None


@dataclass(frozen=True)
class SessionEnd:
    """A finished session, as the store announces it to its subscribers."""

    session_id: str
    reason: str
    """What ended it: "end_session", "finalize" or "timeout"."""
    run_status: str
    """"ok", "failed" or "rejected": the `x-arl-run-status` header of the end call ("ok" for a timeout)."""


EndHook = Callable[[SessionEnd], Awaitable[None]]


@dataclass
class Caller:
    """Who presented a valid key: the kind, the client key index (owner), the session for a session key."""

    kind: KeyKind
    owner: str
    session: Session | None = None


@dataclass
class _Node:
    """What parent matching needs about one interaction."""

    interaction: Interaction
    request_keys: tuple[MessageKey, ...]
    full_keys: tuple[MessageKey, ...]  # request + the returned assistant message
    full_hash: int
    request_hash: int
    tools: str
    prompt_text: str | None = None  # the full render, kept only while the node has no child (memory)


@dataclass
class ParentMatch:
    parent: Interaction | None
    prefix_len: int  # messages of the request covered by parent.messages + response (exact match)
    exact: bool


@dataclass
class Session:
    id: str
    secret: str
    owner: str
    tree: SessionTree
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    first_call_s: float | None = None
    """Seconds from the start to the first LLM call: the agent's start-up, shown in the step timeline."""
    ended: str | None = None  # why: "end_session", "finalize", "timeout", "exported"
    ended_at: float | None = None
    run_status: str = "ok"
    announced: asyncio.Task[None] | None = None
    """The end announcement to subscribers (None: no subscriber, or ended by an export)."""
    _inflight: int = 0
    _idle: asyncio.Event | None = None  # created only while someone waits for the calls in flight
    prefix_breaks: int = 0
    nodes: list[_Node] = field(default_factory=list)
    by_id: dict[str, _Node] = field(default_factory=dict)
    completions: dict[str, list[str]] = field(default_factory=dict)  # API response id -> interaction ids
    responses: dict[str, Any] = field(default_factory=dict)  # Responses API: response id -> stored chain
    sampling: SamplingOverride | None = None
    """Imposed on every call of the session (an evaluation's decoding), whatever the agent asks."""
    last_refusal: str | None = None
    """The last error the proxy answered a call of this session with (`400: ...`): an agent that swallows the
    exception still leaves its cause here, for the rollout to name when a run made no model call."""

    @property
    def api_key(self) -> str:
        return f"{SESSION_KEY_PREFIX}{self.id}-{self.secret}"

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @property
    def inflight(self) -> int:
        """LLM calls of this session being served right now."""
        return self._inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._inflight = value
        if value > 0 and self.first_call_s is None:
            self.first_call_s = time.monotonic() - self.started
        if value == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self, timeout_s: float) -> None:
        """Return once no call is in flight; 409 naming the session if some still are after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._inflight:
            if self._idle is None:
                self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise ApiError(
                    409, f"session {self.id} still has {self._inflight} call(s) in flight after {timeout_s:g}s"
                ) from None

    def find_parent(self, keys: list[MessageKey], tools: str) -> ParentMatch:
        """See the module docstring."""
        hashes = prefix_hashes(keys)
        n = len(keys)
        for node in reversed(self.nodes):
            size = len(node.full_keys)
            if size > n or node.tools != tools or hashes[size] != node.full_hash:
                continue
            if tuple(keys[:size]) == node.full_keys:
                return ParentMatch(node.interaction, size, exact=True)
        for node in reversed(self.nodes):  # a retry / another choice of an earlier request
            if len(node.request_keys) == n and hashes[n] == node.request_hash and tuple(keys) == node.request_keys:
                parent_id = node.interaction.parent_id
                if parent_id is None:
                    return ParentMatch(None, 0, exact=False)
                sibling_of = self.tree.get(parent_id)
                exact = not node.interaction.prefix_break
                return ParentMatch(sibling_of, len(sibling_of.messages) + 1 if exact else 0, exact=exact)
        best: _Node | None = None
        best_len = 0
        for node in reversed(self.nodes):
            shared = common_prefix_len(node.full_keys, keys)
            if shared > best_len:
                best, best_len = node, shared
        return ParentMatch(best.interaction if best else None, 0, exact=False)

    def prompt_text(self, interaction_id: str) -> str | None:
        node = self.by_id.get(interaction_id)
        return node.prompt_text if node is not None else None

    def record(
        self,
        interaction: Interaction,
        request_keys: list[MessageKey],
        response_key: MessageKey,
        tools: str,
        prompt_text: str | None = None,
    ) -> None:
        """Add a finished interaction to the tree and to the parent-matching index."""
        self.tree.add(interaction)
        full = (*request_keys, response_key)
        node = _Node(
            interaction,
            tuple(request_keys),
            full,
            prefix_hashes(full)[-1],
            prefix_hashes(request_keys)[-1],
            tools,
            prompt_text,
        )
        self.nodes.append(node)
        self.by_id[interaction.id] = node
        parent = self.by_id.get(interaction.parent_id or "")
        if parent is not None:
            parent.prompt_text = None
        if interaction.prefix_break:
            self.prefix_breaks += 1


class SessionStore:
    """All sessions of one proxy process, with capacity control and idle cleanup.

    `capacity`: the counts this store shares with the other workers of a pool (`pipeline.proxy.capacity`);
    `worker`: this process's index in a pool, written into the first two hex digits of every session id it
    mints, so that whoever holds an id knows which worker serves the session (`pipeline.proxy.pool`)."""

    def __init__(
        self, config: ProxyConfig, admin_key: str, *, capacity: Capacity | None = None, worker: int | None = None
    ) -> None:
        if not admin_key:
            raise ValueError("the proxy needs a non-empty admin key")
        self.config = config
        self._admin_key = admin_key.encode()
        self._client_keys = [k.encode() for k in config.client_keys if k]
        self.sessions: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        # Open sessions are counted, not scanned, because every start checks them (a scan made starting n
        # sessions cost O(n^2): ~7% of a 512-run rollout step's CPU).
        self.capacity = capacity or Capacity()
        self.worker = worker
        self.prefix_breaks_total = 0
        self._end_hooks: list[EndHook] = []

    @property
    def grants(self) -> int:
        return self.capacity.grants

    @property
    def started_total(self) -> int:
        """Sessions started (by every worker of a pool)."""
        return self.capacity.started

    def on_end(self, hook: EndHook) -> None:
        """Subscribe `hook` to every session's end (see the module docstring)."""
        self._end_hooks.append(hook)

    # -- keys -------------------------------------------------------------------------------
    def identify(self, key: str | None) -> Caller:
        """The caller behind `key`; 401 for a missing/unknown key, 410 for an ended session's key."""
        if not key:
            raise ApiError(401, "missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`")
        raw = key.encode()
        if key.startswith(SESSION_KEY_PREFIX):
            return self._identify_session(key)
        if hmac.compare_digest(raw, self._admin_key):
            return Caller("admin", "admin")
        owner = None
        for i, client in enumerate(self._client_keys):  # no early exit: time does not depend on which matched
            if hmac.compare_digest(raw, client):
                owner = f"client:{i}"
        if owner is not None:
            return Caller("client", owner)
        raise ApiError(401, "invalid API key")

    def _identify_session(self, key: str) -> Caller:
        rest = key[len(SESSION_KEY_PREFIX) :]
        session_id, secret = rest[:_ID_LEN], rest[_ID_LEN + 1 :]
        session = self.sessions.get(session_id)
        if session is None or not hmac.compare_digest(secret.encode(), session.secret.encode()):
            owner = worker_of(session_id)
            if session is None and self.worker is not None and owner is not None and owner != self.worker:
                raise ApiError(
                    421,
                    f"session {session_id} is served by proxy worker {owner}, not this one "
                    f"({self.worker}): send a session's calls to the URL it was started on",
                    code="misdirected_session",
                )
            if session is None and session_id in self._tombstones and len(rest) > _ID_LEN:
                # The id was real once; the secret cannot be checked any more, so say only "ended".
                raise ApiError(
                    410, f"session {session_id} has ended ({self._tombstones[session_id]})", code="session_ended"
                )
            raise ApiError(401, "invalid API key")
        return Caller("session", session.owner, session)

    # -- lifecycle --------------------------------------------------------------------------
    def grant(self, count: int = 1) -> int:
        return self.capacity.grant(count)

    def open_count(self) -> int:
        """Open sessions (of every worker of a pool)."""
        return self.capacity.open

    def start(
        self, owner: str, group_id: str | None, metadata: dict | None, sampling: SamplingOverride | None = None
    ) -> Session:
        self.capacity.admit(require_grant=self.config.require_capacity, max_open=self.config.max_sessions)
        session_id = uuid.uuid4().hex[:_ID_LEN]
        if self.worker is not None:
            session_id = f"{self.worker:02x}{session_id[2:]}"
        tree = SessionTree(session_id, group_id or session_id, metadata)
        session = Session(session_id, secrets.token_urlsafe(24), owner, tree, sampling=sampling)
        self.sessions[session_id] = session
        return session

    def check_open(self, session: Session) -> None:
        if session.ended is not None:
            raise ApiError(
                410,
                f"session {session.id} has ended ({session.ended}): no more calls are accepted",
                code="session_ended",
            )

    async def end(self, session: Session, reason: str, run_status: str = "ok") -> None:
        """End `session` (a no-op if it has ended) and return once its end is announced; 503 if that failed."""
        if session.ended is None:
            self._mark_ended(session, reason)
            session.run_status = run_status if run_status in RUN_STATUSES else "ok"
            if self._end_hooks:
                event = SessionEnd(session.id, reason, session.run_status)
                session.announced = asyncio.create_task(self._announce(event), name=f"session-end-{session.id}")
        if session.announced is not None:
            try:  # shielded: a caller that goes away does not cut the save short for the others
                await asyncio.shield(session.announced)
            except Exception as exc:
                raise ApiError(
                    503,
                    f"session {session.id} ended, but the proxy could not save it "
                    f"({type(exc).__name__}: {exc}); it will not be trained on",
                ) from exc

    async def _announce(self, event: SessionEnd) -> None:
        for hook in self._end_hooks:
            await hook(event)

    def _mark_ended(self, session: Session, reason: str) -> None:
        if session.ended is None:
            session.ended = reason
            session.ended_at = time.monotonic()
            self.capacity.release()

    def export(self, session: Session, style: ExportStyle, discount: float) -> ExportedSession:
        """The session's rows (no step assigned); removes the session. 409 while calls are in flight."""
        if session.inflight:
            raise ApiError(
                409,
                f"session {session.id} has {session.inflight} call(s) in flight: end the session and "
                "let its calls finish before exporting",
            )
        self._mark_ended(session, "exported")
        try:
            rows = session.tree.export(style, discount)
        except TrajectoryError as exc:
            raise ApiError(400, f"cannot export session {session.id}: {exc}") from None
        exported = ExportedSession(
            session.id,
            session.tree.group_id,
            rows,
            len(session.tree),
            session.prefix_breaks,
            session.first_call_s,
            session.last_refusal,
        )
        self.remove(session.id, "exported")
        return exported

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._tombstones:
                raise ApiError(
                    410, f"session {session_id} is gone ({self._tombstones[session_id]})", code="session_ended"
                )
            raise ApiError(404, f"no session {session_id!r} on this proxy")
        return session

    def remove(self, session_id: str, reason: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.prefix_breaks_total += session.prefix_breaks
            if session.ended is None:
                self.capacity.release()
        self._tombstones[session_id] = reason
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    async def sweep(self, now: float | None = None) -> tuple[list[str], list[str]]:
        """End sessions idle past the timeout (announced like any end); drop ended ones unexported for another
        timeout. A subscriber failing on a timed-out session is logged here (it has no end call to answer)."""
        now = time.monotonic() if now is None else now
        timeout = self.config.session_timeout_s
        idle, removed = [], []
        for session in list(self.sessions.values()):
            if session.inflight or (session.announced is not None and not session.announced.done()):
                continue
            if session.ended is None and now - session.last_active >= timeout:
                idle.append(session)
            elif session.ended is not None and now - max(session.last_active, session.ended_at or 0) >= timeout:
                self.remove(session.id, "expired unexported")
                removed.append(session.id)
        if idle or removed:
            log.info("idle sweep: ending %d sessions, removed %d unexported ones", len(idle), len(removed))
        results = await asyncio.gather(*(self.end(s, "timeout") for s in idle), return_exceptions=True)
        for session, result in zip(idle, results, strict=True):
            if isinstance(result, BaseException):
                log.error("session %s timed out, but its end could not be handled: %s", session.id, result)
        return [s.id for s in idle], removed
