"""Weight publication: get version v onto the inference servers, prove it is there, then announce it.

One publication (`Publisher.publish`), with every server registered (routable or not):
1. pause generation everywhere, so no token is generated from half-updated weights. `inference.update_mode`
   says what happens to the requests in flight: `interrupt` pauses them (`inference.pause_mode`, `retract`
   or `in_place`) and they continue under the new version, so their tokens carry two versions (partial
   rollouts); `wait` (pause mode `wait`) answers once they have finished under the old one, new requests
   waiting meanwhile. SGLang has no `wait` pause: it is sent the update unpaused, and its own lock holds
   new requests until those in flight are done;
2. move the tensors (`transports.py`: a disk reload, or a bucketed broadcast over a group, SGLang's
   protocol: begin -> buckets, the last carrying the version -> end);
3. verify every server while it is still paused (`verify.py`: a probe's input log-probabilities and
   a sample of weights against the trainer's own, through SGLang's API; the probe generates nothing,
   which arl's engines run while paused; a real SGLang server runs nothing while paused, nor does vLLM
   holding requests frozen (`interrupt`), so those are resumed first and verified right after);
4. a server that failed to update or verify is taken out: a request in `state/quarantine/` makes the
   inference stage deregister it, restart it from the newest checkpoint and register it again once
   it serves the announced version (docs/reliability.md); it stays paused until then, so it never
   answers from a model that is neither the old nor the new version;
With `trainer.lora.publish: adapter` step 1 is skipped and step 2 loads the version's adapter under a new name
(`adapters.py`): no request's weights change, so nothing is paused or resumed.
5. once `inference.min_servers` (default: every server that took part) verified the version,
   generation resumes on all of them together; the trainer then announces it
   (`state/weight_version.json`). Fewer: the publication waits (deadline `trainer.publish_timeout_s`)
   for servers taken out to come back, and sends them the version too. A server whose inference stage
   ended (it died with its node) never comes back: once the relaunched stage retires it
   (`state/retired/`), it no longer counts among those awaited.

When every server fails verification the same way the fault is what the trainer sent (a tensor
under a wrong name, in a wrong dtype): nothing is announced, the servers stay paused, and the error
names each server's first mismatch; a restarted trainer publishes its resumed version to them.
With no server registered (the trainer run alone, a rerun) nothing is sent and the version is still
announced. Publication runs on rank 0 only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.registry import read_entries, retired_since
from pipeline.engine.server.weights import read_checkpoint
from pipeline.errors import ArlError
from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.trainer.checkpoint import buckets
from pipeline.trainer.lora import base_of, merged_from_files
from pipeline.trainer.publish.adapters import AdapterTransport
from pipeline.trainer.publish.transports import BroadcastTransport, DiskTransport, Outcome, ServerCalls
from pipeline.trainer.publish.verify import Expected, Verdict, Verifier
from schemas.engine_api import served_adapter

log = logging.getLogger("arl.trainer.publish")
BUCKET_BYTES = 256 * 1024**2
_POLL_S = 1.0

StateDict = dict[str, torch.Tensor]
Tamper = Callable[[int, StateDict], StateDict]


@dataclass
class PublishOptions:
    """What a publication needs beyond the transport's kind and the call deadline (see `from_config`)."""

    broadcast_timeout_s: float = 300.0
    verify_model: Path | None = None
    """A Hugging Face directory with the model's `config.json` (the verifier's reference); None: no checks."""
    dtype: str = "float32"
    """The dtype the servers run in (the verification tolerance depends on it)."""
    seed: int = 0
    logprob_atol: float | None = None
    """The probe's tolerance (None: the dtype's default, `verify.TOLERANCES`)."""
    min_servers: int | None = None
    update_mode: str = "interrupt"
    """`interrupt`: pause the requests in flight (`pause_mode`), they continue under the new version;
    `wait`: let them finish under the old one first (new requests wait)."""
    pause_mode: str = "retract"
    interface: str | None = None
    """`cluster.network_interface`: the broadcast group's address is this interface's (None: the route's)."""
    on_bucket: Callable[[int, int], None] | None = None
    """Test seam: called with (version, bucket index) before each broadcast bucket (fault injection)."""
    tamper: Tamper | None = None
    """Test seam: rewrites the tensors sent for a version (a wrong name or dtype), not those verified against."""
    adapter: bool = False
    """`trainer.lora.publish: adapter`: servers load each version's adapter (`adapters.py`), unpaused."""

    @classmethod
    def from_config(cls, config: Any) -> PublishOptions:
        trainer = config.trainer
        return cls(
            broadcast_timeout_s=trainer.broadcast_timeout_s,
            dtype=config.model.dtype,
            seed=trainer.seed,
            verify_model=Path(config.model.path) if trainer.verify else None,
            logprob_atol=trainer.verify_tolerance,
            min_servers=config.inference.min_servers,
            update_mode=config.inference.update_mode,
            pause_mode=config.inference.pause_mode,
            interface=config.cluster.network_interface,
            adapter=trainer.publishes_adapters,
        )

    @property
    def pause(self) -> str:
        """The `/pause_generation` mode of a publication."""
        return "wait" if self.update_mode == "wait" else self.pause_mode


@dataclass
class PublishReport:
    """What one publication did (the trainer logs it as metrics)."""

    version: int
    servers: list[str] = field(default_factory=list)
    """URLs of the servers that verified the version and now serve it."""
    sync_s: float = 0.0
    """Pausing and moving the tensors (every round)."""
    verify_s: float = 0.0
    recovered: list[str] = field(default_factory=list)
    """Servers taken out during this publication (handed to the inference stage to recover)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each server taken out was (by URL)."""
    weights_checked: int = 0
    """Tensors read back from the servers and found equal (0 where no server can show its weights)."""


@dataclass(frozen=True)
class _Member:
    name: str
    url: str
    started_at: float
    backend: str = "hf"

    def scores_while_paused(self, mode: str) -> bool:
        """arl's engines run a prefill-only probe while generation is paused; SGLang's scheduler runs nothing,
        nor does vLLM's while it holds requests frozen in place (every mode but `wait`)."""
        return self.backend == "hf" or (self.backend == "vllm" and mode == "wait")

    def pauses(self, mode: str) -> bool:
        """SGLang has no `wait` pause: its weight update itself waits for the requests in flight."""
        return not (self.backend == "sglang" and mode == "wait")

    @property
    def key(self) -> str:
        """A restarted server keeps its name and URL: its start time tells the two lives apart."""
        return f"{self.url}@{self.started_at}"


class Publisher:
    """Publishes versions to the servers of one run (one per trainer process, rank 0)."""

    def __init__(
        self, kind: str, paths: RunPaths, timeout_s: float, tied_embeddings: bool, options: PublishOptions | None = None
    ) -> None:
        if kind not in ("disk", "nccl"):
            raise ValueError(f"unknown trainer.weight_sync {kind!r}; valid: disk, nccl")
        self.paths = paths
        self.timeout_s = timeout_s
        self.tied = tied_embeddings
        self.options = options or PublishOptions()
        self.calls = ServerCalls(timeout_s)
        self.transport: DiskTransport | BroadcastTransport | AdapterTransport = (
            AdapterTransport(self.calls)
            if self.options.adapter
            else DiskTransport(self.calls)
            if kind == "disk"
            else BroadcastTransport(
                self.calls,
                paths,
                self.options.broadcast_timeout_s,
                self.options.on_bucket,
                interface=self.options.interface,
            )
        )
        model = self.options.verify_model
        self.verifier = (
            Verifier(
                model,
                self.options.dtype,
                tied_embeddings,
                seed=self.options.seed,
                logprob_atol=self.options.logprob_atol,
            )
            if model
            else None
        )

    def publish(self, version: int, checkpoint: Path | None, state_dict: StateDict | None) -> PublishReport:
        """Put `version` on the servers and verify it (module docstring); raises when it cannot be announced."""
        report = PublishReport(version)
        members = self._members()
        if not members:
            log.info("version %d: no inference server registered; none was updated", version)
            return report
        tensors = state_dict if state_dict is not None else self._read(version, checkpoint)
        # The trainer's side of the check (a forward of the probe) runs while the tensors travel.
        lora = served_adapter(version) if self.options.adapter else None
        expected = self.calls.pool.submit(self.verifier.expect, version, tensors, lora) if self.verifier else None
        sent = {k: v for k, v in tensors.items() if not (self.tied and k == "lm_head.weight")}
        if self.options.tamper is not None:
            sent = self.options.tamper(version, dict(sent))
        required = self.options.min_servers or len(members)
        verified: dict[str, _Member] = {}
        seen: set[str] = set()
        deadline = time.monotonic() + self.timeout_s
        pending = members
        while True:
            if pending:
                seen.update(m.key for m in pending)
                self._round(version, pending, checkpoint, sent, expected, verified, report)
            if self.options.min_servers is None:  # every server that took part, less those that can never return
                required = max(1, len(members) - len(self._retired(members, verified)))
            if len(verified) >= required:
                break
            if time.monotonic() > deadline:
                raise ArlError(
                    f"version {version} verified on {len(verified)} server(s), {required} needed "
                    f"(inference.min_servers); taken out: {report.reasons}; no server came back within "
                    f"trainer.publish_timeout_s={self.timeout_s:.0f}s (see logs/inference/); version not announced"
                )
            time.sleep(_POLL_S)
            pending = [m for m in self._members() if m.key not in seen]
        report.servers = [m.url for m in verified.values()]
        if isinstance(self.transport, AdapterTransport):
            self.transport.retire(version, report.servers)
        else:
            self._resume(report.servers, version)
        return report

    def _read(self, version: int, checkpoint: Path | None) -> StateDict:
        """The version's full weights from disk: the checkpoint, or base + adapter for adapter publication."""
        path = _required(checkpoint)
        if self.options.adapter and version > 0:
            return merged_from_files(path, self.options.verify_model or base_of(path)) if self.verifier else {}
        return read_checkpoint(path)

    def _round(
        self,
        version: int,
        pending: list[_Member],
        checkpoint: Path | None,
        sent: dict[str, torch.Tensor],
        pending_expected: Future[Expected] | None,
        verified: dict[str, _Member],
        report: PublishReport,
    ) -> None:
        """Pause, send and verify `pending`; add who verified to `verified`, take the others out."""
        t0 = time.perf_counter()
        urls = [m.url for m in pending]
        mode = self.options.pause
        paused = [m.url for m in pending if m.pauses(mode) and not self.options.adapter]  # adapters: none paused
        failed = self.calls.failures(paused, "POST", "/pause_generation", {"mode": mode})
        live = [u for u in urls if u not in failed]
        outcome = self.transport.send(version, live, checkpoint, buckets(sent, BUCKET_BYTES)) if live else Outcome()
        failed.update(outcome.failed)
        report.sync_s += time.perf_counter() - t0
        # A real SGLang server scores nothing while paused: it resumes first and is verified right after
        # (docs/reliability.md: the one window in which it may answer from unverified weights).
        early = [m.url for m in pending if m.url in paused and m.url in outcome.ok and not m.scores_while_paused(mode)]
        self._resume(early, version)
        t1 = time.perf_counter()
        expected = pending_expected.result() if pending_expected is not None else None
        verdicts = self._verify(outcome.ok, expected)
        report.verify_s += time.perf_counter() - t1
        report.weights_checked += sum(v.weights_checked for v in verdicts)
        bad = {v.url: v.problem or "verification failed" for v in verdicts if not v.ok}
        if bad:  # a server resumed early (SGLang) must stop answering from weights that failed
            self.calls.each(list(bad), "POST", "/pause_generation", {"mode": "retract"})
        if bad and not verified and len(bad) == len(outcome.ok) == len(urls):
            raise ArlError(
                f"version {version} failed verification on every server ({len(bad)}), so what the trainer sent is "
                f"wrong (a tensor under a wrong name, in a wrong dtype) or every server corrupted it: "
                + "; ".join(bad.values())
                + ". Nothing is announced; the servers stay paused until a trainer "
                "publishes a verified version (a restarted trainer publishes the version it resumes from)"
            )
        failed.update(bad)
        for member in pending:
            if member.url in failed:
                self._take_out(member, version, failed[member.url])
                report.recovered.append(member.name)
                report.reasons[member.url] = failed[member.url]
            else:
                verified[member.key] = member

    def _verify(self, urls: list[str], expected: Expected | None) -> list[Verdict]:
        if self.verifier is None or expected is None or not urls:
            return [Verdict(u, ok=True) for u in urls]
        verifier, client = self.verifier, self.calls.client

        async def every() -> list[Verdict]:
            import asyncio

            return list(await asyncio.gather(*(verifier.check(client, u, expected) for u in urls)))

        verdicts = self.calls.runner.run(every(), self.timeout_s + 30)
        for v in verdicts:
            log.info(
                "version %d on %s: %s (probe max |diff| %.2g, %d weights read back, %.2fs)",
                expected.version,
                v.url,
                "verified" if v.ok else f"FAILED: {v.problem}",
                v.probe_max_diff,
                v.weights_checked,
                v.seconds,
            )
        return verdicts

    def _retired(self, members: list[_Member], verified: dict[str, _Member]) -> set[str]:
        """Members not verified whose inference stage has ended (retired by its successor: `retire_entry`)."""
        return retired_since(self.paths, {m.name: m.started_at for m in members if m.key not in verified})

    def _take_out(self, member: _Member, version: int, reason: str) -> None:
        """Ask the inference stage to deregister and recover `member` (it stays paused meanwhile)."""
        log.error("taking inference server %s (%s) out at version %d: %s", member.name, member.url, version, reason)
        write_json_atomic(
            self.paths.quarantine_entry(member.name),
            {
                "server": member.name,
                "url": member.url,
                "started_at": member.started_at,
                "version": version,
                "reason": reason,
                "at": time.time(),
            },
        )

    def _resume(self, urls: list[str], version: int) -> None:
        for url, why in self.calls.failures(urls, "POST", "/continue_generation", {}).items():
            log.error("%s verified version %d but did not resume generation: %s", url, version, why)

    def _members(self) -> list[_Member]:
        """Every registered server not waiting to be taken out (routable or not: all get every version)."""
        queue = self.paths.quarantine
        quarantined = {p.stem for p in queue.glob("*.json")} if queue.is_dir() else set()
        return [
            _Member(name, e.url, e.started_at, e.backend)
            for name, e in read_entries(self.paths).items()
            if name not in quarantined
        ]

    @property
    def group_name(self) -> str:
        """The broadcast group's name ("" without one)."""
        return getattr(self.transport, "group_name", "")

    def close(self) -> None:
        """Leave the broadcast group on both sides (the servers outlive this trainer)."""
        try:
            self.transport.close()
        except Exception as exc:  # closing must not mask the trainer's own outcome
            log.warning("leaving the weight group failed: %s", exc)
        self.calls.close()


def make_publisher(
    kind: str, paths: RunPaths, timeout_s: float, tied_embeddings: bool, options: PublishOptions | None = None
) -> Publisher:
    return Publisher(kind, paths, timeout_s, tied_embeddings, options)


def _required(checkpoint: Path | None) -> Path:
    if checkpoint is None:
        raise ValueError("publishing needs the state dict or a checkpoint directory")
    return checkpoint
