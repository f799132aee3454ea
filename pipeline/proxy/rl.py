"""Session control, rewards and export over HTTP: who may do what (docs/proxy.md, "Keys").

* admin key: everything, on any session (the rollout stage, operators).
* client key: start sessions, set rewards on and end *its own* sessions (a session started with
  the same client key); never export. Another client's session answers 404, as if absent.
* session key: only its own session; naming another session is a 403.

The work itself is the session store's (`pipeline.proxy.sessions`); `reward` is shared with the
in-process control (`pipeline.proxy.local`).
"""

from __future__ import annotations

from typing import Any

from pipeline.proxy.errors import ApiError
from pipeline.proxy.sessions import Caller, Session, SessionStore
from pipeline.proxy.trajectory import TrajectoryError, UnknownInteraction
from schemas.api.rl import (
    AnyAgentFinalize,
    AnyAgentSetReward,
    EndSessionRequest,
    ExportRequest,
    SetRewardRequest,
    StartSessionRequest,
)


def target_session(store: SessionStore, caller: Caller, session_id: str | None) -> Session:
    """The session a control call acts on, enforcing the ownership rules above."""
    if caller.kind == "session":
        assert caller.session is not None
        if session_id is not None and session_id != caller.session.id:
            raise ApiError(403, "a session key can only act on its own session")
        return caller.session
    if session_id is None:
        raise ApiError(400, "session_id is required with an admin or client key", param="session_id")
    session = store.get(session_id)
    if caller.kind == "client" and session.owner != caller.owner:
        raise ApiError(404, f"no session {session_id!r} on this proxy for this key")
    return session


def start_session(store: SessionStore, caller: Caller, body: StartSessionRequest | None) -> dict[str, Any]:
    if caller.kind not in ("admin", "client"):
        raise ApiError(403, "starting a session needs the admin key or a client key, not a session key")
    body = body or StartSessionRequest()
    session = store.start(caller.owner, body.group_id, body.metadata, body.sampling)
    return {"session_id": session.id, "api_key": session.api_key, "group_id": session.tree.group_id}


def set_reward(store: SessionStore, caller: Caller, body: SetRewardRequest) -> dict[str, Any]:
    session = target_session(store, caller, body.session_id)
    rewarded = reward(session, body.reward, body.interaction_id)
    return {"session_id": session.id, "interaction_ids": rewarded, "reward": body.reward}


def reward(session: Session, value: float, interaction_id: str | None) -> list[str]:
    """Reward the last completion or a named one (every choice of an `n > 1` id); the ids rewarded."""
    targets = _reward_targets(session, interaction_id)
    for target in targets:
        try:
            session.tree.set_reward(value, target)
        except UnknownInteraction as exc:
            raise ApiError(404, str(exc), param="interaction_id") from None
        except TrajectoryError as exc:
            raise ApiError(400, str(exc), param="reward") from None
    if targets == [None]:
        return [_last_id(session)]
    return [t for t in targets if t is not None]


def _reward_targets(session: Session, interaction_id: str | None) -> list[str | None]:
    if interaction_id is None:
        if session.tree.last() is None:
            raise ApiError(404, f"session {session.id} has no completion yet: make an LLM call before setting a reward")
        return [None]
    if interaction_id in session.completions:  # a completion/response/message id with n choices
        return list(session.completions[interaction_id])
    return [interaction_id]


def _last_id(session: Session) -> str:
    last = session.tree.last()
    return last.id if last is not None else ""


def any_agent_set_reward(store: SessionStore, caller: Caller, body: AnyAgentSetReward) -> dict[str, Any]:
    return set_reward(store, caller, SetRewardRequest(reward=body.reward, interaction_id=body.completion_id))


async def end_session(
    store: SessionStore, caller: Caller, body: EndSessionRequest | None, reason: str, run_status: str = "ok"
) -> dict[str, Any]:
    """End the session; answers once the end is announced (a subscriber's failure is a 503)."""
    session = target_session(store, caller, body.session_id if body else None)
    await store.end(session, reason, run_status)
    return {"session_id": session.id, "ended": True, "num_interactions": len(session.tree)}


async def finalize(
    store: SessionStore, caller: Caller, body: AnyAgentFinalize, run_status: str = "ok"
) -> dict[str, Any]:
    target_session(store, caller, None)  # a session key, its own session
    if body.final_reward is not None:
        set_reward(store, caller, SetRewardRequest(reward=body.final_reward))
    return await end_session(store, caller, None, "finalize", run_status)


async def export(store: SessionStore, caller: Caller, body: ExportRequest) -> dict[str, Any]:
    """The session's rows (every shard column but `step`; `created_at` in epoch ms); removes the session. Waits up
    to `wait_s` for calls in flight (409 naming the session if they still run)."""
    if caller.kind != "admin":
        raise ApiError(403, "exporting trajectories needs the admin key")
    session = store.get(body.session_id)
    if body.wait_s > 0:
        await session.wait_idle(body.wait_s)
    return store.export(session, body.style, body.discount).to_json()
