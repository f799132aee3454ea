"""Request coalescing (`inference.batch_window_ms`): single-prompt `/generate` calls to one server, gathered for a
few milliseconds and sent as one SGLang batch request.

Why: every completion an agent asks for is one HTTP request from the proxy to an engine, and on a small machine
that request costs more CPU than the tokens (measured on the demo: 512 six-token completions a step, the HTTP
handling about half of the hf engine's CPU and a tenth of the rollout process's). SGLang's `/generate` takes a
batch (lists of `input_ids`, `sampling_params`, `rid`, ...) and answers a list in the same order, so one request
can carry many completions.

The cost is latency coupling: a batch is answered when its longest completion finishes, so a short completion
gathered with a long one waits for it. That is why it is off by default and suits short, similar completions
(single-turn tasks with a small `max_tokens`), not agents whose turns vary widely in length.

What does not change: each completion keeps its own `rid` (a cancelled caller aborts only its own), its own
sampling parameters, adapter and top-logprobs count, and its own result. A batch the server refuses with a 4xx
is sent again one completion per request, so only the completion at fault gets the error; a connection failure
reaches every caller, and each fails over as an uncoalesced call does. Streams are never coalesced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pipeline.engine.client.wire import EngineError, single_answer

log = logging.getLogger("arl.engine.client")

Post = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""(server URL, /generate body) -> the decoded JSON answer (an object, or a list for a batch)."""

_PER_PROMPT = ("input_ids", "sampling_params", "rid", "top_logprobs_num", "lora_path")
"""Body fields a batch carries as one list entry per prompt."""


@dataclass(frozen=True)
class BatchPolicy:
    """How an engine client gathers completions (`inference.batch_window_ms`); `window_s` 0 = never."""

    window_s: float = 0.0
    max_batch: int = 64


class Coalescer:
    """Gathers the bodies `submit`ted for one server over `window_s` (or until `max_batch`) into one request."""

    def __init__(self, url: str, post: Post, policy: BatchPolicy) -> None:
        self.url = url
        self.post = post
        self.policy = policy
        self._pending: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        """The server's answer for this one body (a single-prompt, non-streamed `/generate` body)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        entry = (body, future)
        self._pending.append(entry)
        if len(self._pending) >= self.policy.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.policy.window_s, self._flush)
        try:
            return await future
        except asyncio.CancelledError:
            if entry in self._pending:  # not sent yet: it never reaches the server
                self._pending.remove(entry)
            raise

    async def close(self) -> None:
        """Send what is gathered and wait for the batches in flight."""
        self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch), name="engine-client-batch")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]]) -> None:
        live = [(body, future) for body, future in batch if not future.done()]
        if len(live) > 1:
            try:
                answers = await self.post(self.url, batch_body([body for body, _ in live]))
            except EngineError as exc:
                if exc.status is None or exc.status >= 500:
                    _fail(live, exc)
                    return
                # A 4xx names one completion's problem (or several): ask again one by one, so only those fail.
                log.debug(
                    "batch of %d refused by %s (%s); sending its completions one by one", len(live), self.url, exc
                )
            except Exception as exc:  # a connection failure: every caller fails over on its own
                _fail(live, exc)
                return
            else:
                _deliver(live, answers, self.url)
                return
        await asyncio.gather(*(self._send_one(body, future) for body, future in live))

    async def _send_one(self, body: dict[str, Any], future: asyncio.Future[dict[str, Any]]) -> None:
        try:
            answer = single_answer(await self.post(self.url, body), self.url)
        except Exception as exc:
            _fail([(body, future)], exc)
        else:
            if not future.done():
                future.set_result(answer)


def batch_body(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One SGLang batch request for single-prompt bodies (the same `return_logprob` and no stream, as the engine
    client sends them): per-prompt fields become lists in order; one absent from every body stays absent."""
    batch: dict[str, Any] = {"return_logprob": bodies[0]["return_logprob"], "stream": False}
    for key in _PER_PROMPT:
        values = [body.get(key) for body in bodies]
        if any(v is not None for v in values):
            batch[key] = [0 if v is None and key == "top_logprobs_num" else v for v in values]
    return batch


def _deliver(live: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]], answers: Any, url: str) -> None:
    if not isinstance(answers, list) or len(answers) != len(live):
        got = f"{len(answers)} answers" if isinstance(answers, list) else type(answers).__name__
        _fail(live, EngineError(f"{url}/generate answered a batch of {len(live)} with {got}", server=url))
        return
    for (_, future), answer in zip(live, answers, strict=True):
        if future.done():
            continue
        if isinstance(answer, dict):
            future.set_result(answer)
        else:
            future.set_exception(
                EngineError(
                    f"{url}/generate answered {type(answer).__name__} in a batch, expected an object", server=url
                )
            )


def _fail(live: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]], exc: BaseException) -> None:
    for _, future in live:
        if not future.done():
            future.set_exception(exc)
