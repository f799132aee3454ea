"""The `hf` engine's scheduler: one thread owns the model and runs continuous batching.

Each loop iteration: run queued commands (aborts, pause, weight loads) → admit waiting requests
(prefilled together as one left-padded batch, then merged into the running batch) → one decode
step for every running sequence → deliver the new tokens to the waiting HTTP handlers (a request that
is not streamed gets them all in one event when it finishes). A request that arrives mid-generation
starts at the next iteration; a finished sequence leaves the batch at once, so nobody waits for an
unrelated long completion. With a prefix cache (`prefix_cache.py`),
admission prefills each prompt from its longest cached prefix on, and a finished sequence's KV is kept
there; every applied weight update empties it.

Prompt logprobs (`logprob_start_len` >= 0, SGLang's input logprobs): such a request is prefilled as
a batch of its own, keeping the logits of the scored positions only (`logits_to_keep`), so the other
requests of the step pay nothing for it; the scores go out with the request's first event. A request
with `max_new_tokens` 0 is prefilled only when it wants its prompt scored (else finished at once).

Weight updates (`update`) are applied between steps, with SGLang's semantics: the update waits
until the requests in flight have finished (new requests queue meanwhile), unless generation is
paused (`/pause_generation`), in which case it applies at once and the paused requests continue
with the new weights after `/continue_generation` (mode `in_place` keeps their KV cache from the
old weights; mode `retract` recomputes it from the tokens under the new weights). Mode `wait` admits
nothing new but lets the running requests finish; the pause is answered once none runs. Every sampled
token is labelled with the version that sampled it (`Seq.versions`), so a request continued across an
update reports both.
`abort_all_requests` aborts the requests in flight instead of waiting for them. While paused only the
trainer's verification probes run (`rid` prefix `VERIFY_RID_PREFIX`, prompt scoring with nothing to
generate): a new version is checked before any request is served from it.

Why a thread and not the event loop: a forward pass blocks for milliseconds to seconds; on the
event loop it would stall every HTTP request, health check and stream of the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engine.server.backend import Progress
from pipeline.engine.server.hf import routing, sequences
from pipeline.engine.server.hf.kvbatch import KVBatch, cache_tensors, dynamic_cache
from pipeline.engine.server.hf.lora_adapters import LoraAdapters, serving
from pipeline.engine.server.hf.prefix_cache import PrefixCache, close_holes, prefill_inputs, store_finished
from pipeline.engine.server.hf.sampling import prompt_logprobs, sample_batch
from pipeline.engine.server.hf.sequences import GenRequest, Seq, finish_of, is_probe, wants_prompt_scored

log = logging.getLogger("arl.engine.batcher")
DECODE_DELAY_ENV = "ARL_TEST_DECODE_DELAY_S"


@dataclass
class _Update:
    apply: Callable[[], Any]
    version: int | None
    abort_all: bool
    future: concurrent.futures.Future[Any]


class Scheduler:
    """Continuous batching over a Hugging Face causal LM (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int,
        max_context: int,
        eos_ids: set[int],
        weight_version: int,
        return_original_logprob: bool = False,
        seed: int | None = None,
        prefix_cache: PrefixCache | None = None,
        lora: LoraAdapters | None = None,
    ) -> None:
        self.model = model
        self.routers = routing.find_routers(model)
        """The model's MoE routers (none for a dense model): `return_routed_experts` reads their choices."""
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.eos_ids = eos_ids
        self.weight_version = weight_version
        self.return_original_logprob = return_original_logprob
        self.prefix_cache = prefix_cache
        self.lora = lora
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0))
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.paused: str | None = None
        self.error: BaseException | None = None
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._batch: KVBatch | None = None
        self._updates: list[_Update] = []
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._outbox: list[tuple[Seq, Progress]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="hf-engine-scheduler", daemon=True)
        self.decode_delay_s = float(os.environ.get(DECODE_DELAY_ENV) or 0)
        """TEST HOOK, 0 unless ARL_TEST_DECODE_DELAY_S is set: every decode step sleeps that long, so a tiny
        model's completions are still running when a test's trainer publishes (partial rollouts)."""

    # -- thread-safe API --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, req: GenRequest) -> None:
        with self._lock:
            self._waiting.append(Seq(req))
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the scheduler thread between two steps; its result or error lands in the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._commands.append((fn, future))
        self._wake.set()
        return future

    def update(
        self, apply: Callable[[], Any], *, version: int | None, abort_all: bool
    ) -> concurrent.futures.Future[Any]:
        """Run the weight update `apply` once the requests in flight are done (or at once when paused)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._updates.append(_Update(apply, version, abort_all, future))
        self._wake.set()
        return future

    def abort(self, rid: str | None, message: str = "aborted by request") -> int:
        """Abort one request (by rid, matching n>1 children `rid_i` too) or all (rid None). Scheduler thread only."""
        count = 0
        for seq in [*self._waiting, *self._running]:
            if seq.finish is None and (rid is None or seq.req.rid == rid or seq.req.rid.startswith(f"{rid}_")):
                self._finish(seq, {"type": "abort", "message": message})
                count += 1
        self._drop_finished()
        return count

    def pause(self, mode: str) -> None:
        """Scheduler thread only. `abort`: abort everything, then pause; `retract`: requeue running requests;
        `wait`: admit nothing new but let the running requests finish (`drained` says when)."""
        if mode == "abort":
            self.abort(None, "aborted by /pause_generation")
        elif mode == "retract":
            self._requeue_running()
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def serving(self, adapter: Any) -> bool:
        """Whether a waiting or running request is served by `adapter` (scheduler thread)."""
        with self._lock:
            waiting = list(self._waiting)
        return any(s.req.lora is adapter and s.finish is None for s in [*waiting, *self._running])

    def drained(self) -> bool:
        """No request is running (with mode `wait`: the pause is complete)."""
        return not self._running

    def load(self) -> dict[str, int]:
        return {"running": len(self._running), "waiting": len(self._waiting)}

    # -- the loop ---------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._wake.clear()
                    worked = self._iteration()
                    self._flush()
                    if not worked:
                        self._wake.wait(timeout=1.0)
        except BaseException as exc:  # a dead scheduler must be visible: /health turns 503
            self.error = exc
            log.exception("scheduler thread died")
            self._fail_all(f"engine scheduler died: {exc}")
        finally:
            self._fail_all("engine stopped")

    def _iteration(self) -> bool:
        worked = self._run_commands()
        worked |= self._maybe_update()
        if self.paused is None and not self._updates:
            worked |= self._admit()
        elif not self._updates:
            worked |= self._admit_probes()
        if self._running and self.paused in (None, "wait"):
            self._guarded(self._decode_step)
            worked = True
        return worked

    def _run_commands(self) -> bool:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for fn, future in commands:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        return bool(commands)

    def _maybe_update(self) -> bool:
        if not self._updates:
            return False
        if any(u.abort_all for u in self._updates):
            self.abort(None, "aborted for a weight update")
        if self._running and self.paused in (None, "wait"):
            return False  # drain: the running requests finish first; admission is stopped meanwhile
        with self._lock:
            updates, self._updates = self._updates, []
        for update in updates:
            try:
                result = update.apply()
                if update.version is not None:
                    self.weight_version = update.version
                update.future.set_result(result)
            except Exception as exc:
                update.future.set_exception(exc)
        if self.prefix_cache is not None:  # its KV came from the weights just replaced
            self.prefix_cache.clear()
        return True

    def _admit(self) -> bool:
        free = self.max_batch_size - len(self._running)
        fresh: list[Seq] = []
        with self._lock:
            while self._waiting and len(fresh) < free:
                seq = self._waiting.popleft()
                if seq.finish is None:
                    fresh.append(seq)
        scoring = [s for s in fresh if wants_prompt_scored(s)]
        for seq in [s for s in fresh if s.req.max_new_tokens == 0 and not wants_prompt_scored(s)]:
            self._finish(seq, {"type": "length", "length": 0})
        plain = [s for s in fresh if s.finish is None and not wants_prompt_scored(s)]
        if plain:
            self._guarded(lambda: self._prefill(plain), plain)
        for seq in scoring:  # one at a time: only its scored positions' logits are kept
            keep = len(seq.req.input_ids) - seq.req.logprob_start_len
            self._guarded(lambda: self._prefill([seq], keep=keep), [seq])  # noqa: B023 (called at once)
        return bool(plain or scoring)

    def _admit_probes(self) -> bool:
        """While paused: run the trainer's verification probes (they generate nothing, so no request sees
        weights before the trainer has checked them); everything else keeps waiting."""
        with self._lock:
            probes = [s for s in self._waiting if s.finish is None and is_probe(s)]
            for seq in probes:
                self._waiting.remove(seq)
        for seq in probes:
            keep = len(seq.req.input_ids) - seq.req.logprob_start_len
            self._guarded(lambda: self._prefill([seq], keep=keep), [seq])  # noqa: B023 (called at once)
        return bool(probes)

    def _prefill(self, fresh: list[Seq], keep: int = 1) -> None:
        """Prefill `fresh` and sample their first tokens; `keep` > 1 (one sequence): score its prompt too."""
        inputs = prefill_inputs(self.prefix_cache, fresh, self.pad_id, self.device)  # from cached prefixes
        with serving(self.lora, fresh), routing.capturing(self.routers, routing.wanted(fresh)) as routed:
            out = self.model(
                input_ids=inputs.ids,
                attention_mask=inputs.mask,
                position_ids=inputs.positions,
                past_key_values=dynamic_cache(inputs.past, self.model.config),
                use_cache=True,
                logits_to_keep=max(keep, 1),
            )
        routing.assign_prefill(routed, fresh)
        for row, seq in enumerate(fresh):
            if wants_prompt_scored(seq):
                seq.prompt = prompt_logprobs(
                    out.logits[row], seq.req.input_ids, seq.req.logprob_start_len, seq.req.sampling.top_logprobs_num
                )
        if all(s.req.max_new_tokens == 0 for s in fresh):  # scored only: nothing to generate
            for seq in fresh:
                self._finish(seq, {"type": "length", "length": 0})
            return
        batch = close_holes(KVBatch(cache_tensors(out.past_key_values), inputs.mask))
        self._batch = batch if self._batch is None else self._batch.merge(batch)
        self._running.extend(fresh)
        self._sample(fresh, out.logits[:, -1])
        self._drop_finished()

    def _decode_step(self) -> None:
        assert self._batch is not None
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        last = torch.tensor([[s.output[-1]] for s in self._running], device=self.device)
        mask, positions, cache = self._batch.decode_inputs(self.model.config)  # the forward extends `cache` in place
        wanted = routing.wanted(self._running)
        with serving(self.lora, self._running), routing.capturing(self.routers, wanted) as routed:
            out = self.model(
                input_ids=last, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            )
        routing.assign_decode(routed, self._running)
        self._sample(self._running, out.logits[:, -1])
        self._drop_finished()

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        out = sample_batch(
            logits,
            [s.req.sampling for s in seqs],
            generator=self.generator,
            return_original_logprob=self.return_original_logprob,
        )
        for seq, token, logprob, top in zip(seqs, out.tokens, out.logprobs, out.top, strict=True):
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(seq.version_now(self.weight_version))
            if top is not None:
                seq.top.append(top)
            finish = finish_of(seq, token, self.tokenizer, self.max_context)
            if finish is not None:
                self._finish(seq, finish)
            elif seq.req.stream:
                self._outbox.append((seq, self._progress(seq)))

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if s.finish is None]
        if len(keep) != len(self._running):
            if self.prefix_cache is not None and self._batch is not None:
                store_finished(self.prefix_cache, self._running, self._batch)
            self._running = [self._running[i] for i in keep]
            self._batch = self._batch.select(keep) if self._batch is not None else None
        with self._lock:
            if any(s.finish is not None for s in self._waiting):
                self._waiting = deque(s for s in self._waiting if s.finish is None)

    def _guarded(self, step: Callable[[], None], seqs: list[Seq] | None = None) -> None:
        """Run a forward step; if it fails, abort the sequences involved (not the whole server)."""
        try:
            step()
        except Exception as exc:
            involved = seqs if seqs is not None else list(self._running)
            log.exception("forward step failed; aborting %d sequences", len(involved))
            for seq in involved:
                self._finish(seq, {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"})
            if self._batch is not None and self._batch.rows != len(self._running):
                self._requeue_running()  # rows and sequences disagree: recompute the survivors' caches
            self._drop_finished()

    def _requeue_running(self) -> None:
        """Put running sequences back at the head of the queue; their KV is rebuilt from their tokens."""
        with self._lock:
            for seq in reversed(self._running):
                self._waiting.appendleft(seq)
        self._running, self._batch = [], None

    # -- delivery ---------------------------------------------------------------------------
    def _progress(self, seq: Seq) -> Progress:
        return sequences.next_progress(seq, self.weight_version, routing.answer(seq))

    def _finish(self, seq: Seq, finish: dict[str, Any]) -> None:
        if seq.finish is not None:
            return
        seq.finish = finish
        self._outbox.append((seq, self._progress(seq)))

    def _flush(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Progress], Progress]]] = {}
        for seq, event in outbox:
            by_loop.setdefault(seq.req.loop, []).append((seq.req.events, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(sequences.deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending = [*self._waiting, *self._running]
            self._waiting.clear()
            updates, self._updates = self._updates, []
            commands, self._commands = self._commands, deque()
        self._running, self._batch = [], None
        for seq in pending:
            self._finish(seq, {"type": "abort", "message": message})
        for update in updates:
            update.future.set_exception(RuntimeError(message))
        for _, future in commands:
            future.set_exception(RuntimeError(message))
        self._flush()
