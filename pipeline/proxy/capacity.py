"""Session capacity: granted slots, open sessions, sessions started — one count per proxy, however many workers.

`proxy.require_capacity` makes each new session spend one slot an admin granted (`/grant_capacity`),
and `proxy.max_sessions` bounds the sessions open at once. With one proxy process the three counts are
plain integers. With `proxy.workers > 1` (`pipeline.proxy.pool`) a session may start on any worker,
so the counts live in one shared-memory array that every worker and the stage's own process update
under one lock: a slot granted through any worker is spent exactly once, and the bound on open
sessions holds across all of them, not per worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableSequence
from typing import Any

from pipeline.proxy.errors import ApiError

_GRANTS, _OPEN, _STARTED = 0, 1, 2


class Capacity:
    """The counts of one proxy (see the module docstring); in-process unless built with `shared`."""

    def __init__(self, shared: Any = None) -> None:
        """`shared`: a `multiprocessing` synchronized array of 3 signed 64-bit integers (`new_shared_counts`),
        or None for counts private to this process."""
        self.shared = shared
        self._values: MutableSequence[int] = shared.get_obj() if shared is not None else [0, 0, 0]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[MutableSequence[int]]:
        if self.shared is None:
            yield self._values
            return
        with self.shared.get_lock():
            yield self._values

    @property
    def grants(self) -> int:
        """Slots granted and not yet spent by a session start."""
        return int(self._values[_GRANTS])

    @property
    def open(self) -> int:
        """Sessions started and not yet ended (nor exported)."""
        return int(self._values[_OPEN])

    @property
    def started(self) -> int:
        """Sessions ever started."""
        return int(self._values[_STARTED])

    def grant(self, count: int) -> int:
        """Add `count` slots; the slots available now."""
        with self._locked() as values:
            values[_GRANTS] += count
            return int(values[_GRANTS])

    def admit(self, *, require_grant: bool, max_open: int) -> None:
        """Count one new session, spending a slot if `require_grant`; 429 (nothing counted) if none is left or
        `max_open` sessions are open. Check and count are one step under the lock: two workers cannot both
        take the last slot."""
        with self._locked() as values:
            if require_grant and values[_GRANTS] < 1:
                raise ApiError(
                    429,
                    "no capacity: the rollout has not granted a session slot yet "
                    "(proxy.require_capacity; an admin grants slots with POST /grant_capacity)",
                )
            if values[_OPEN] >= max_open:
                raise ApiError(
                    429,
                    f"too many open sessions ({max_open}, proxy.max_sessions): "
                    "end finished sessions with POST /rl/end_session",
                )
            if require_grant:
                values[_GRANTS] -= 1
            values[_OPEN] += 1
            values[_STARTED] += 1

    def release(self) -> None:
        """One open session ended (or was exported or dropped while open)."""
        with self._locked() as values:
            values[_OPEN] -= 1


def new_shared_counts(context: Any) -> Any:
    """The shared array for `Capacity(shared=...)`, from a `multiprocessing` context (passed to each worker)."""
    return context.Array("q", 3, lock=True)
