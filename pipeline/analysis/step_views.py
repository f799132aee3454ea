"""Reading what `arl inspect` shows: a part file, a step dir or a run dir resolved to steps (`StepView`), a
task filter, and token ids turned back into text with the shard's tokenizer (`Decoder`).

Every failure is an `InspectError` (an `ArlError`: one `error: ...` line, exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import ValidationError

from pipeline.errors import ArlError
from pipeline.run.paths import MANIFEST, RunPaths, parse_step_name
from pipeline.run.shards import read_part, read_step_dir, row_metadata
from schemas.config.rollout import task_of
from schemas.manifest import Manifest
from schemas.trajectory import META_TOKENIZER, SCHEMA

LIGHT_COLUMNS = [name for name in SCHEMA.names if name not in ("input_ids", "logprobs")]
"""Enough for the tables and summaries: steps not decoded skip the two large columns."""


class InspectError(ArlError):
    """The path is not something `arl inspect` can show."""


@dataclass
class StepView:
    step: int
    table: pa.Table
    tokenizer: str
    source: Path
    summary: dict[str, Any] = field(default_factory=dict)


# -- loading ------------------------------------------------------------------------------------
def load_views(path: Path, *, step: int | None, with_tokens: bool, limit: int) -> list[StepView]:
    """Resolve PATH to steps; read all columns only where samples will be decoded."""
    if not path.exists():
        raise InspectError(f"no such file or directory: {path}")
    try:
        if path.is_file():
            return [_part_view(path, step)]
        if (path / MANIFEST).exists() or parse_step_name(path.name) is not None:
            return [_step_view(path, all_columns=with_tokens)]
        steps_parent = path / "trajectories" if (path / "trajectories").is_dir() else path
        return _run_views(steps_parent, path, step, with_tokens=with_tokens, limit=limit)
    except PermissionError as exc:
        raise InspectError(f"cannot read {exc.filename or path}: permission denied") from None


def _part_view(path: Path, step: int | None) -> StepView:
    if path.name == MANIFEST:
        return _step_view(path.parent, all_columns=True)
    if path.suffix != ".parquet":
        raise InspectError(f"{path} is not a part file (*.parquet), a step dir or a run dir")
    expected = None
    manifest_path = path.parent / MANIFEST
    if manifest_path.exists():  # inside a published step: verify against its checksum too
        try:
            manifest = Manifest.model_validate_json(manifest_path.read_bytes())
        except ValidationError as exc:
            raise InspectError(f"{manifest_path}: not a valid step manifest ({exc.error_count()} errors)") from None
        expected = next((p.sha256 for p in manifest.parts if p.file == path.name), None)
    table = read_part(path, expected_sha256=expected)
    steps = sorted(set(table.column("step").to_pylist()))
    if step is not None and step not in steps:
        raise InspectError(f"{path} holds steps {steps}, not step {step}")
    tokenizer = (table.schema.metadata or {}).get(META_TOKENIZER, b"").decode()
    return StepView(step if step is not None else (steps[0] if steps else 0), table, tokenizer, path)


def _step_view(step_dir: Path, *, all_columns: bool) -> StepView:
    table, manifest = read_step_dir(step_dir, columns=None if all_columns else LIGHT_COLUMNS)
    return StepView(manifest.step, table, manifest.tokenizer, step_dir)


def _run_views(steps_parent: Path, given: Path, step: int | None, *, with_tokens: bool, limit: int) -> list[StepView]:
    children = [parse_step_name(p.name) for p in steps_parent.iterdir()]
    if not any(c is not None for c in children):
        raise InspectError(
            f"{given} is not a part file (*.parquet), a step dir (step_NNNNNN) or a run dir (holding trajectories/)"
        )
    complete = (
        RunPaths(steps_parent.parent).complete_steps()
        if steps_parent.name == "trajectories"
        else sorted(s for s in children if s is not None and (steps_parent / f"step_{s:06d}" / MANIFEST).exists())
    )
    if step is not None:
        if step not in complete:
            raise InspectError(f"step {step} is not a complete step of {given}; complete steps: {complete or 'none'}")
        complete = [step]
    if not complete:
        raise InspectError(f"{given} has no complete step yet (no step dir with {MANIFEST})")
    views, listed = [], 0
    for s in complete:
        decode_here = with_tokens and listed < limit
        view = _step_view(steps_parent / f"step_{s:06d}", all_columns=decode_here)
        listed += view.table.num_rows
        views.append(view)
    return views


def advantages(view: StepView) -> list[float]:
    """Each row's advantage as the trainer computes it (`trainer.algorithm.advantage` of the run's config, GRPO when
    the view is not inside a run dir): the reward the row's sampled tokens are trained with, every turn of a
    concat row alike. Rows whose group is cut by `--task` or a partial read get the baseline of the rows present."""
    from pipeline.trainer.advantages import compute_advantages

    table = view.table
    rewards = [float(r) if r is not None else 0.0 for r in table.column("reward").to_pylist()]
    return [float(a) for a in compute_advantages(rewards, table.column("group_id").to_pylist(), _estimator(view))]


def _estimator(view: StepView) -> Any:
    for folder in view.source.parents:
        if (folder / "trajectories").is_dir() and (folder / "config.yaml").exists():
            import yaml

            config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
            return ((config.get("trainer") or {}).get("algorithm") or {}).get("advantage", "grpo")
    return "grpo"


def read_full(view: StepView) -> StepView:
    """The view with every column (token ids and log-probs too): a step dir read light is read again."""
    if "input_ids" in view.table.column_names:
        return view
    full = _step_view(view.source, all_columns=True)
    full.summary = view.summary
    return full


def only_task(views: list[StepView], task: str, path: Path) -> list[StepView]:
    """The rows of one task (`metadata.task`; rows without one belong to `default`); steps without any dropped."""
    found: set[str] = set()
    kept = []
    for view in views:
        metadata = view.table.column("metadata").to_pylist()
        tasks = [task_of(row_metadata(m, i)) for i, m in enumerate(metadata)]
        found.update(tasks)
        mask = pa.array([t == task for t in tasks], type=pa.bool_())
        if any(t == task for t in tasks):
            kept.append(StepView(view.step, view.table.filter(mask), view.tokenizer, view.source))
    if not kept:
        raise InspectError(f"no sample of task {task!r} in {path}; its tasks: {', '.join(sorted(found)) or 'none'}")
    return kept


class Decoder:
    """Token ids → text segments with the shard's tokenizer; token ids alone if it cannot be loaded."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer: Any = None
        self.note = ""
        if not tokenizer_path or not Path(tokenizer_path).exists():
            self.note = (
                f"tokenizer {tokenizer_path or '(none named in the shard metadata)'} not found: "
                "showing token ids instead of text"
            )
            return
        try:
            self.tokenizer = _load_tokenizer(Path(tokenizer_path))
        except (OSError, ValueError, RuntimeError) as exc:
            self.note = f"tokenizer at {tokenizer_path} could not be loaded ({exc}): showing token ids"

    def segments(self, ids: list[int], mask: list[int], versions: list[int]) -> list[dict[str, Any]]:
        """Runs of equal (sampled, version): one prompt/tool run or one turn's sampled tokens each."""
        out: list[dict[str, Any]] = []
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or mask[i] != mask[start] or versions[i] != versions[start]:
                chunk = ids[start:i]
                text = self.tokenizer.decode(chunk, skip_special_tokens=False) if self.tokenizer else None
                out.append(
                    {
                        "sampled": bool(mask[start]),
                        "version": versions[start] if mask[start] else None,
                        "ids": chunk,
                        "text": text,
                    }
                )
                start = i
        return out


def _load_tokenizer(path: Path) -> Any:
    """The raw `tokenizers` file when there is one: decoding needs only its byte-level decoder, and
    importing `tokenizers` takes 0.1 s where `transformers` takes seconds (inspect should feel instant)."""
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json"))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def json_default(value: Any) -> Any:
    """numpy scalars as numbers, anything else JSON does not know as its str."""
    if isinstance(value, np.integer | np.floating):
        return value.item()
    return str(value)
