"""Write and read one training step's trajectories: Parquet parts plus `_MANIFEST.json`.

Contracts: docs/run-directory.md (where a step lives, publication) and docs/trajectory-schema.md
(the columns, the manifest). `write_step` takes typed rows (`schemas.trajectory.TrajectoryRow`) and
is the one place they become Arrow.

A step is built in a staging dir beside its final place (`trajectories/step_%06d.<rand>.tmp`),
its manifest written last, and the whole dir renamed into place (`pipeline.run.handoff.publish_dir`).
So a reader sees a complete step or none, even when the writer is SIGKILLed at any point, and a
re-write replaces the old step whole (no part of the old version survives next to the new one).

The manifest records each part's sha256; readers verify it before trusting a part, because a
shared file system can hand back a truncated or stale file long after the writer is gone.

Reading a step (manifest first, checksums verified) is `pipeline.run.shard_reader`'s; its readers are
re-exported here, so a caller imports one module for a step's files.

Rows are validated with vectorised checks of the same invariants as
`schemas.trajectory.validate_row` (which loops in Python: 20 s for a 20M-token step, so the
writer would spend more time checking than writing).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import SchemaError
from pipeline.run.handoff import publish_dir, staging_dir
from pipeline.run.paths import MANIFEST, RunPaths
from pipeline.run.shard_reader import (
    StepNotFound,
    list_complete_steps,
    read_manifest,
    read_part,
    read_step,
    read_step_dir,
    step_part_files,
)
from schemas.manifest import Manifest, PartEntry, Totals, VersionRange
from schemas.trajectory import (
    FINISH_REASONS,
    LIST_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    TrajectoryRow,
    schema_with_metadata,
)

__all__ = [
    "StepNotFound",
    "list_complete_steps",
    "read_manifest",
    "read_part",
    "read_step",
    "read_step_dir",
    "step_part_files",
    "step_stats",
    "write_step",
]

# Measured with benchmarks/shard_io.py: zstd level 1 is ~3x faster to write than level 3 for ~6 %
# more bytes; masks and versions are long runs, which dictionary (RLE/bit-packed) pages store in
# a few bytes and decode fast; BYTE_STREAM_SPLIT lets zstd see float32 logprobs' exponent bytes
# together. Token ids stay PLAIN: they have no order for delta coding to exploit.
COMPRESSION = "zstd"
COMPRESSION_LEVEL = 1
_DICTIONARY_COLUMNS = [
    "session_id",
    "group_id",
    "parent_id",
    "finish_reason",
    "loss_mask.list.element",
    "versions.list.element",
]
_COLUMN_ENCODING = {"logprobs.list.element": "BYTE_STREAM_SPLIT"}
# ~1k-token samples make a row group of 512 rows ~2–4 MB compressed: large enough for fast
# sequential reads, small enough that `arl inspect --limit 10` does not decode a whole part.
ROW_GROUP_ROWS = 512
_PRODUCER_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


# -- writing ------------------------------------------------------------------------------------
def write_step(
    paths: RunPaths,
    step: int,
    rows: Sequence[TrajectoryRow],
    *,
    producer: str,
    tokenizer: str,
    extra: dict | None = None,
    rows_per_part: int = 4096,
    dest: Path | None = None,
) -> Manifest:
    """Validate `rows`, write them as parts + manifest, and publish the step atomically (replacing it), in
    `paths.step_dir(step)` or in `dest` (an evaluation's directory: the same layout, read by the same tools)."""
    if not _PRODUCER_RE.match(producer):
        raise ValueError(f"producer {producer!r} must match {_PRODUCER_RE.pattern} (it is part of file names)")
    if rows_per_part < 1:
        raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
    where = f"step {step}"
    steps = {row.step for row in rows}
    if steps and steps != {step}:
        raise SchemaError(
            f"{where}: rows carry step values {sorted(steps, key=str)}; every row written to step "
            f"{step} must have step={step} (assign it with `row.at_step({step})`)"
        )
    table = rows_to_table(rows, tokenizer)
    validate_table_fast(table, where=where)
    final = dest if dest is not None else paths.step_dir(step)
    # A writer killed earlier left its staging dir behind; only this step's leftovers are ours to remove.
    for leftover in final.parent.glob(f"{final.name}.*.tmp") if final.parent.exists() else []:
        _remove(leftover)
    with staging_dir(final) as staged:
        parts = []
        for seq, start in enumerate(range(0, table.num_rows, rows_per_part)):
            name = RunPaths.shard_name(producer, seq)
            parts.append(_write_part(staged / name, table.slice(start, rows_per_part)))
        manifest = _manifest(step, producer, tokenizer, parts, table, extra or {})
        publish_dir(staged, final, MANIFEST, manifest.model_dump(mode="json"))
    return manifest


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def rows_to_table(rows: Sequence[TrajectoryRow], tokenizer: str) -> pa.Table:
    """Typed rows → an Arrow table of the shard schema (column by column), with a clear error on bad values."""
    columns: dict[str, pa.Array] = {}
    for field in SCHEMA:
        values = [getattr(row, field.name) for row in rows]
        try:
            columns[field.name] = pa.array(values, type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise SchemaError(f"column {field.name!r} cannot be stored as {field.type}: {exc}") from None
    return pa.table(columns, schema=schema_with_metadata(tokenizer))


def _write_part(path: Path, table: pa.Table) -> PartEntry:
    """Serialise in memory so the sha256 is of exactly the bytes written, with one pass over them."""
    buffer = io.BytesIO()
    pq.write_table(
        table,
        buffer,
        compression=COMPRESSION,
        compression_level=COMPRESSION_LEVEL,
        row_group_size=ROW_GROUP_ROWS,
        use_dictionary=_DICTIONARY_COLUMNS,
        column_encoding=_COLUMN_ENCODING,
    )
    data = buffer.getvalue()
    path.write_bytes(data)  # publish_dir fsyncs every staged file before the marker
    return PartEntry(
        file=path.name,
        rows=table.num_rows,
        tokens=int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0),
        sampled_tokens=_sum_flat(table.column("loss_mask")),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def _sum_flat(column: pa.ChunkedArray) -> int:
    return int(pc.sum(pc.list_flatten(column), min_count=0).as_py() or 0)


def _manifest(
    step: int, producer: str, tokenizer: str, parts: list[PartEntry], table: pa.Table, extra: dict
) -> Manifest:
    versions = pc.list_flatten(table.column("versions"))
    sampled = pc.filter(versions, pc.greater_equal(versions, 0))
    weight_versions = None
    if len(sampled):
        bounds = pc.min_max(sampled).as_py()
        weight_versions = VersionRange(min=bounds["min"], max=bounds["max"])
    return Manifest(
        schema_version=SCHEMA_VERSION,
        step=step,
        created_at=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        producer=producer,
        tokenizer=tokenizer,
        parts=parts,
        totals=Totals(
            rows=table.num_rows,
            tokens=sum(p.tokens for p in parts),
            sampled_tokens=sum(p.sampled_tokens for p in parts),
            sessions=len(pc.unique(table.column("session_id"))),
            groups=len(pc.unique(table.column("group_id"))),
        ),
        weight_versions=weight_versions,
        extra=extra,
    )


# -- validation ---------------------------------------------------------------------------------
def validate_table_fast(table: pa.Table, where: str = "rows") -> None:
    """Every invariant of `schemas.trajectory.validate_row`, checked column-wise with numpy."""
    n = table.num_rows
    if n == 0:
        return
    sample_ids = table.column("sample_id")

    def fail(row: int, what: str) -> None:
        raise SchemaError(f"{where} row {row} (sample {sample_ids[int(row)].as_py()!r}): {what}")

    for field in SCHEMA:
        col = table.column(field.name)
        if not field.nullable and col.null_count:
            fail(int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]), f"{field.name} is null")
    lengths = {c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in LIST_COLUMNS}
    for c in LIST_COLUMNS[1:]:
        if (bad := np.flatnonzero(lengths[c] != lengths["input_ids"])).size:
            fail(bad[0], f"list columns differ in length: { {k: int(v[bad[0]]) for k, v in lengths.items()} }")
    length = lengths["input_ids"].astype(np.int64)
    if (bad := np.flatnonzero(length == 0)).size:
        fail(bad[0], "empty input_ids")
    flat = {c: pc.list_flatten(table.column(c)).to_numpy() for c in LIST_COLUMNS}
    mask, lp, ver = flat["loss_mask"], flat["logprobs"], flat["versions"]
    offsets = np.concatenate([[0], np.cumsum(length)])
    row_of = np.repeat(np.arange(n), length)
    if (bad := np.flatnonzero((mask != 0) & (mask != 1))).size:
        fail(row_of[bad[0]], "loss_mask holds values other than 0/1")
    if (bad := np.flatnonzero(np.add.reduceat(mask.astype(np.int64), offsets[:-1]) == 0)).size:
        fail(bad[0], "loss_mask has no sampled token")
    local = np.arange(len(mask)) - offsets[row_of]
    first = np.minimum.reduceat(np.where(mask == 1, local, np.iinfo(np.int64).max), offsets[:-1])
    prompt_len = table.column("prompt_len").to_numpy()
    if (bad := np.flatnonzero(prompt_len != first)).size:
        fail(bad[0], f"prompt_len={prompt_len[bad[0]]} but the first sampled token is at {first[bad[0]]}")
    unsampled_bad = (mask == 0) & ((lp != 0.0) | (ver != -1))
    if (bad := np.flatnonzero(unsampled_bad)).size:
        i = bad[0]
        fail(row_of[i], f"token {local[i]} is not sampled but has logprob={lp[i]}, version={ver[i]} (want 0.0, -1)")
    if (bad := np.flatnonzero((mask == 1) & ((ver < 0) | (lp > 1e-6)))).size:
        i = bad[0]
        fail(row_of[i], f"sampled token {local[i]} has version={ver[i]}, logprob={lp[i]} (want >= 0, <= 0)")
    if (bad := np.flatnonzero(flat["input_ids"] < 0)).size:
        fail(row_of[bad[0]], "negative token id")
    if (bad := np.flatnonzero(table.column("num_turns").to_numpy() < 1)).size:
        fail(bad[0], "num_turns < 1")
    reasons = table.column("finish_reason").to_pylist()
    for i, reason in enumerate(reasons):
        if reason not in FINISH_REASONS:
            fail(i, f"finish_reason {reason!r} not in {sorted(FINISH_REASONS)}")
    for i, text in enumerate(table.column("metadata").to_pylist()):
        try:
            meta = json.loads(text)
        except json.JSONDecodeError as exc:
            fail(i, f"metadata is not JSON: {exc}")
        if not isinstance(meta, dict):
            fail(i, "metadata must be a JSON object")


# -- statistics ---------------------------------------------------------------------------------
STATS_COLUMNS = ["step", "session_id", "group_id", "loss_mask", "versions", "reward", "finish_reason", "metadata"]
"""What `step_stats` reads: everything but `input_ids` and `logprobs`, the two large columns."""


def per_row_sampled_and_versions(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: length, sampled tokens, min and max weight version over sampled tokens (-1 if none)."""
    lengths = pc.list_value_length(table.column("loss_mask")).to_numpy(zero_copy_only=False).astype(np.int64)
    if not table.num_rows:
        empty = np.zeros(0, dtype=np.int64)
        return lengths, empty, empty, empty
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy().astype(np.int64)
    versions = pc.list_flatten(table.column("versions")).to_numpy().astype(np.int64)
    nonempty = lengths > 0
    sampled = np.zeros(len(lengths), dtype=np.int64)
    vmin = np.full(len(lengths), -1, dtype=np.int64)
    vmax = np.full(len(lengths), -1, dtype=np.int64)
    if mask.size:
        big = np.iinfo(np.int64).max
        at = starts[nonempty]
        sampled[nonempty] = np.add.reduceat(mask, at)
        low = np.minimum.reduceat(np.where(mask == 1, versions, big), at)
        vmin[nonempty] = np.where(low == big, -1, low)
        vmax[nonempty] = np.maximum.reduceat(np.where(mask == 1, versions, -1), at)
    return lengths, sampled, vmin, vmax


def row_metadata(text: str, row: int) -> dict[str, Any]:
    """A row's `metadata` JSON object; SchemaError naming the row if a foreign writer broke it."""
    try:
        meta = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"row {row}: metadata is not JSON ({exc}): {str(text)[:80]!r}") from None
    if not isinstance(meta, dict):
        raise SchemaError(f"row {row}: metadata must be a JSON object, got {str(text)[:80]!r}")
    return meta


def step_stats(table: pa.Table, step: int | None = None) -> dict[str, Any]:
    """Per-step summary: count, reward mean/std, length percentiles, staleness (= step − min version), breaks.

    Needs only `STATS_COLUMNS`, so a caller can skip reading the token ids and log-probs.
    """
    n = table.num_rows
    lengths, sampled, vmin, _ = per_row_sampled_and_versions(table)
    rewards = table.column("reward").to_numpy()
    if step is None and n:
        step = int(pc.max(table.column("step")).as_py())
    metas = table.column("metadata").to_pylist()
    breaks = sum(1 for i, text in enumerate(metas) if row_metadata(text, i).get("prefix_break"))
    reasons = pc.value_counts(table.column("finish_reason")).to_pylist() if n else []
    known = vmin[vmin >= 0]
    stale = step - known if step is not None else np.zeros(0)
    return {
        "step": step,
        "count": n,
        "sessions": len(pc.unique(table.column("session_id"))),
        "groups": len(pc.unique(table.column("group_id"))),
        "tokens": int(lengths.sum()),
        "sampled_tokens": int(sampled.sum()),
        "reward_mean": float(rewards.mean()) if n else None,
        "reward_std": float(rewards.std()) if n else None,
        "length_p50": float(np.percentile(lengths, 50)) if n else None,
        "length_p90": float(np.percentile(lengths, 90)) if n else None,
        "length_max": int(lengths.max()) if n else None,
        "min_version": int(known.min()) if known.size else None,
        "staleness_max": int(stale.max()) if stale.size else None,
        "staleness_mean": float(stale.mean()) if stale.size else None,
        "prefix_breaks": breaks,
        "finish_reasons": {r["values"]: r["counts"] for r in reasons},
    }
