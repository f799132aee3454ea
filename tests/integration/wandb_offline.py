"""Read an offline W&B run back from its `.wandb` file, decoding each record with wandb's own protobufs.

wandb >= 0.20 ships no Python reader of the file (its Go core writes and syncs it). The framing is
LevelDB's log format behind a 7-byte header: 32 KiB blocks of chunks, each `crc32 (of type byte +
payload), length, type` (FULL, or FIRST/MIDDLE.../LAST for a record split across blocks). Every
chunk's checksum is verified, so a misread framing fails loudly instead of yielding wrong records.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version 0
CHUNK = struct.Struct("<IHB")  # crc32, payload length, chunk type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    run: Any
    """The `RunRecord` (id, project, group, job type, display name, tags, notes, config)."""
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """W&B step -> the logged values (wandb's own `_step`, `_runtime`, `_timestamp` left out)."""
    exit_code: int | None = None
    """From the exit record `run.finish` writes; None if the run never finished."""


def isolate_wandb(monkeypatch: Any, tmp_path: Path) -> None:
    """wandb's settings, cache and data dirs under the test's tmp dir; no API key, no mode from the environment."""
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def raw_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a .wandb file"
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        payload = data[pos + CHUNK.size : pos + CHUNK.size + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"{path}: bad checksum at byte {pos}"
        pos += CHUNK.size + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
        else:
            raise AssertionError(f"{path}: unknown chunk type {kind} at byte {pos}")


def read_offline_run(run_dir: Path) -> OfflineRun:
    """The run in `run_dir` (`.../wandb/offline-run-<time>-<id>/`, holding `run-<id>.wandb`), once this process's
    W&B runs are all on disk."""
    import json

    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    # wandb's service process writes the file and may still be flushing it after `run.finish()` returns (a stage
    # process waits for it at exit); shutting the service down waits for every run of this process.
    wandb.teardown()

    (path,) = run_dir.glob("run-*.wandb")
    out: OfflineRun | None = None
    history: dict[int, dict[str, float]] = {}
    exit_code = None
    for raw in raw_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out = OfflineRun(record.run)
        elif kind == "history":
            values = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item
            }
            history[record.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert out is not None, f"{path} holds no run record"
    out.history, out.exit_code = history, exit_code
    return out


def offline_runs(wandb_dir: Path, run_id: str) -> list[OfflineRun]:
    """Every offline part of the W&B run `run_id` under `wandb_dir`, oldest first: one per process that
    opened it (`offline-run-<time>-<id>`, with a `-1` suffix when two started in the same second)."""
    parts = [read_offline_run(d) for d in wandb_dir.glob(f"offline-run-*-{run_id}*")]
    parts = [p for p in parts if p.run.run_id == run_id]
    return sorted(parts, key=lambda p: p.run.start_time.ToNanoseconds())
