"""Trajectory shard schema, version 1 (docs/trajectory-schema.md): one Parquet row per training sample.

Columns (every list column has the same length L in a row):

| column        | type              | shape / meaning |
| ------------- | ----------------- | --------------- |
| step          | int64             | training step k the sample belongs to (consumed by trainer step k) |
| session_id    | string            | one agent run |
| sample_id     | string            | interaction id (`individual` style) or leaf interaction id (`concat`) |
| parent_id     | string, nullable  | parent interaction in the session's conversation tree (null at a root) |
| group_id      | string            | samples of one prompt: the GRPO group |
| input_ids     | list<int32> [L]   | the whole token sequence exactly as the engine saw and produced it |
| loss_mask     | list<int8> [L]    | 1 on tokens sampled from the policy, 0 on prompt / tool / user tokens |
| logprobs      | list<float32> [L] | behaviour log-probability of each sampled token; 0.0 where loss_mask is 0 |
| versions      | list<int32> [L]   | weight version that sampled each token; -1 where loss_mask is 0 |
| reward        | float32           | reward after discounting over the conversation tree |
| prompt_len    | int32             | tokens before the first sampled token (= index of the first 1 in loss_mask) |
| num_turns     | int32             | LLM calls merged into this row (1 in `individual` style) |
| finish_reason | string            | `stop`, `length`, `tool_calls` or `abort` (of the row's last LLM call) |
| created_at    | timestamp[ms, UTC]| when the row's last LLM call finished |
| metadata      | string            | JSON object: dataset index, user fields, prefix-break info |

Worked multi-turn example (concat style, token ids abbreviated). An agent asks for the weather,
the model calls a tool, the tool answers, the model replies:

    turn 1 prompt  : <|im_start|>user\\nWeather in Paris?<|im_end|>\\n<|im_start|>assistant\\n  -> ids P1 (len 12)
    turn 1 sampled : <tool_call>{"name":"weather",...}</tool_call><|im_end|>            -> ids S1 (len 9, v=3)
    turn 2 suffix  : \\n<|im_start|>user\\n<tool_response>sunny</tool_response><|im_end|>\\n
                     <|im_start|>assistant\\n                                            -> ids T2 (len 11)
    turn 2 sampled : It is sunny.<|im_end|>                                             -> ids S2 (len 5, v=4)

    input_ids  = P1 + S1 + T2 + S2                              (L = 37)
    loss_mask  = [0]*12 + [1]*9 + [0]*11 + [1]*5
    logprobs   = [0]*12 + lp(S1) + [0]*11 + lp(S2)
    versions   = [-1]*12 + [3]*9 + [-1]*11 + [4]*5
    prompt_len = 12, num_turns = 2, finish_reason = "stop"

Note the `\\n` after the first `<|im_end|>`: the model stopped at `<|im_end|>`, so the newline the
template puts after it belongs to the *next* turn's (unsampled) suffix, never silently dropped.

In Python a row is a `TrajectoryRow` from the moment a session is exported
(`pipeline.proxy.trajectory.SessionTree.export`) to the shard writer (`pipeline.run.shards.write_step`), the one
place it becomes Arrow. Its wire form (`to_wire`: every column but `step`, `created_at` in epoch ms)
is what the proxy's `/export_trajectories` answers and what the standalone proxy's spool stores.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

import pyarrow as pa

from pipeline.errors import SchemaError

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "SchemaError",
    "TrajectoryRow",
    "check_file_metadata",
    "rows_from_dicts",
    "validate_row",
    "validate_table",
]

SCHEMA_VERSION = 1
META_SCHEMA_VERSION = b"arl.schema_version"
META_TOKENIZER = b"arl.tokenizer"
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "abort"})
LIST_COLUMNS = ("input_ids", "loss_mask", "logprobs", "versions")

SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("parent_id", pa.string(), nullable=True),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("versions", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryRow:
    """One training sample: a shard row, typed (each field is the column of the same name above)."""

    session_id: str
    sample_id: str
    parent_id: str | None
    group_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    prompt_len: int
    num_turns: int
    finish_reason: str
    created_at: int
    """Epoch milliseconds, UTC (the column's timestamp[ms, UTC] value)."""
    metadata: str
    step: int | None = None
    """The training step the row belongs to; None until a producer assigns it one (`at_step`): an
    exported session does not know which step it will fill."""

    def at_step(self, step: int) -> TrajectoryRow:
        return replace(self, step=step)

    def as_dict(self) -> dict[str, Any]:
        """Every column (a shallow view: the lists are the row's own)."""
        return {name: getattr(self, name) for name in COLUMNS}

    def to_wire(self) -> dict[str, Any]:
        """The JSON form: every column but `step`, in schema order."""
        return {name: getattr(self, name) for name in WIRE_COLUMNS}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> TrajectoryRow:
        """A row from its JSON form; TypeError on a missing or unknown column."""
        return cls(**data)


COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
WIRE_COLUMNS: tuple[str, ...] = tuple(name for name in COLUMNS if name != "step")
assert set(COLUMNS) == {f.name for f in fields(TrajectoryRow)}, "TrajectoryRow and SCHEMA name the same columns"


def rows_from_dicts(rows: Iterable[Mapping[str, Any]]) -> list[TrajectoryRow]:
    """Rows given as dicts of every column (`created_at` an aware datetime or epoch ms) → typed rows.

    For producers that build plain dicts (synthetic data, tables read back with `to_pylist`).
    """
    out = []
    for i, row in enumerate(rows):
        missing = [name for name in COLUMNS if name not in row]
        if missing:
            raise SchemaError(
                f"row {i} (sample {row.get('sample_id')!r}) has no column {missing[0]!r}; rows need "
                f"every column of {list(COLUMNS)}"
            )
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise SchemaError(f"row {i} (sample {row.get('sample_id')!r}) has unknown columns {unknown}")
        values = dict(row)
        values["created_at"] = epoch_ms(row["created_at"], f"row {i}")
        out.append(TrajectoryRow(**values))
    return out


def epoch_ms(value: Any, where: str = "row") -> int:
    """`created_at` as epoch milliseconds, from an aware datetime or a number of milliseconds."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise SchemaError(f"{where}: created_at {value!r} has no time zone; use datetime.now(UTC)")
        return int(value.timestamp() * 1000)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    raise SchemaError(f"{where}: created_at must be a timezone-aware datetime or epoch ms, got {value!r}")


def schema_with_metadata(tokenizer: str) -> pa.Schema:
    """SCHEMA plus the key-value metadata every shard carries."""
    return SCHEMA.with_metadata({META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(), META_TOKENIZER: tokenizer.encode()})


def check_file_metadata(metadata: Mapping[bytes, bytes] | None, where: str) -> str:
    """Refuse files of another schema version; return the tokenizer path they name."""
    metadata = metadata or {}
    found = metadata.get(META_SCHEMA_VERSION)
    if found is None:
        raise SchemaError(f"{where}: no {META_SCHEMA_VERSION.decode()} in the Parquet metadata: not an arl shard")
    if found.decode() != str(SCHEMA_VERSION):
        raise SchemaError(
            f"{where}: trajectory schema version {found.decode()}, this arl reads version {SCHEMA_VERSION}"
        )
    return metadata.get(META_TOKENIZER, b"").decode()


def validate_row(row: TrajectoryRow | Mapping[str, Any], where: str = "row") -> None:
    """Check every invariant of docs/trajectory-schema.md on one row (typed, or a dict of column -> value)."""
    if isinstance(row, TrajectoryRow):
        row = row.as_dict()
    missing = [f.name for f in SCHEMA if f.name not in row]
    if missing:
        raise SchemaError(f"{where}: missing columns {missing}")
    lengths = {name: len(row[name]) for name in LIST_COLUMNS}
    if len(set(lengths.values())) != 1:
        raise SchemaError(f"{where}: list columns differ in length: {lengths}")
    mask, logprobs, versions = row["loss_mask"], row["logprobs"], row["versions"]
    if not lengths["input_ids"]:
        raise SchemaError(f"{where}: empty input_ids")
    if any(m not in (0, 1) for m in mask):
        raise SchemaError(f"{where}: loss_mask holds values other than 0/1")
    if not any(mask):
        raise SchemaError(f"{where}: loss_mask has no sampled token")
    first = list(mask).index(1)
    if row["prompt_len"] != first:
        raise SchemaError(f"{where}: prompt_len={row['prompt_len']} but the first sampled token is at {first}")
    for i, (m, lp, v) in enumerate(zip(mask, logprobs, versions, strict=True)):
        if m == 0 and (lp != 0.0 or v != -1):
            raise SchemaError(f"{where}: token {i} is not sampled but has logprob={lp}, version={v} (want 0.0, -1)")
        if m == 1 and (v < 0 or lp > 1e-6):
            raise SchemaError(f"{where}: sampled token {i} has version={v}, logprob={lp} (want >= 0, <= 0)")
    if row["num_turns"] < 1:
        raise SchemaError(f"{where}: num_turns={row['num_turns']} < 1")
    if row["finish_reason"] not in FINISH_REASONS:
        raise SchemaError(f"{where}: finish_reason {row['finish_reason']!r} not in {sorted(FINISH_REASONS)}")
    if any(t < 0 for t in row["input_ids"]):
        raise SchemaError(f"{where}: negative token id")
    try:
        meta = json.loads(row["metadata"])
    except (TypeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"{where}: metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise SchemaError(f"{where}: metadata must be a JSON object")


def validate_rows(rows: Iterable[Mapping[str, Any]], where: str = "shard") -> int:
    """Validate every row; return how many there were."""
    count = 0
    for count, row in enumerate(rows, start=1):
        validate_row(row, where=f"{where} row {count - 1} (sample {row.get('sample_id')!r})")
    return count


def validate_table(table: pa.Table, where: str = "shard") -> int:
    """Check the Arrow schema (names and types) and every row's invariants."""
    if not table.schema.remove_metadata().equals(SCHEMA, check_metadata=False):
        raise SchemaError(f"{where}: Arrow schema differs from trajectory schema v{SCHEMA_VERSION}:\n{table.schema}")
    return validate_rows(table.to_pylist(), where=where)
