"""`arl inspect PATH`: an offline look at trajectory shards (a part file, a step dir or a run dir).

Shows a table of samples and a per-step summary; `--decode` renders each row's turns with the
tokenizer named in the shard metadata, sampled tokens styled apart from prompt/tool tokens.
`--format json` is for scripts, `--format html` writes one self-contained page.

Every failure is an `ArlError` (printed by the CLI as one `error: ...` line, exit code 2): a
person pointing this at the wrong path wants to know why in one line, not a traceback.
"""

from __future__ import annotations

import html
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import ValidationError

from pipeline.errors import ArlError
from pipeline.paths import MANIFEST, RunPaths, parse_step_name
from pipeline.shards import per_row_sampled_and_versions, read_part, read_step_dir, row_metadata, step_stats
from schemas.config.rollout import task_of
from schemas.manifest import Manifest
from schemas.trajectory import META_TOKENIZER, SCHEMA

FORMATS = ("table", "json", "html")
SAMPLED_OPEN, SAMPLED_CLOSE = "«", "»"
"""Brackets around sampled text where colour is unavailable (a pipe, NO_COLOR): still visibly different."""


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


def inspect_path(
    path: Path, *, step: int | None = None, decode: bool = False, fmt: str = "table",
    output: Path | None = None, limit: int = 50, task: str | None = None,
) -> int:  # fmt: skip
    """Show the shards under `path`; returns the exit code (0)."""
    if fmt not in FORMATS:
        raise InspectError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if limit < 0:
        raise InspectError(f"--limit must be >= 0, got {limit}")
    views = load_views(Path(path), step=step, with_tokens=decode, limit=limit)
    if task is not None:
        views = only_task(views, task, path)
    for view in views:
        view.summary = step_stats(view.table, view.step)
    samples, notes = collect_samples(views, decode=decode, limit=limit)
    if fmt == "json":
        payload = {"source": str(path), "steps": [v.summary for v in views], "samples": samples, "notes": notes}
        sys.stdout.write(json.dumps(payload, indent=2, default=_json_default) + "\n")
    elif fmt == "html":
        target = output or Path.cwd() / f"{_slug(Path(path))}.inspect.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render_html(str(path), views, samples, notes))
        print(target)
    else:
        render_rich(views, samples, notes, decode=decode)
    return 0


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
        raise InspectError(f"{given} is not a part file (*.parquet), a step dir (step_NNNNNN) or a run dir "
                           "(holding trajectories/)")  # fmt: skip
    complete = RunPaths(steps_parent.parent).complete_steps() if steps_parent.name == "trajectories" else sorted(
        s for s in children if s is not None and (steps_parent / f"step_{s:06d}" / MANIFEST).exists()
    )  # fmt: skip
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


# -- samples ------------------------------------------------------------------------------------
def collect_samples(views: list[StepView], *, decode: bool, limit: int) -> tuple[list[dict[str, Any]], list[str]]:
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    total = sum(v.table.num_rows for v in views)
    decoders: dict[str, Decoder] = {}
    for view in views:
        if len(samples) >= limit:
            break
        table = view.table.slice(0, limit - len(samples))
        lengths, sampled, vmin, vmax = per_row_sampled_and_versions(table)
        has_tokens = "input_ids" in table.column_names
        for i, row in enumerate(table.to_pylist()):
            sample = {
                "step": row["step"], "session_id": row["session_id"], "sample_id": row["sample_id"],
                "parent_id": row["parent_id"], "group_id": row["group_id"], "num_turns": row["num_turns"],
                "tokens": int(lengths[i]), "sampled_tokens": int(sampled[i]), "prompt_len": row["prompt_len"],
                "reward": row["reward"], "finish_reason": row["finish_reason"],
                "min_version": int(vmin[i]), "max_version": int(vmax[i]),
                "metadata": row_metadata(row["metadata"], i),
            }  # fmt: skip
            if decode and has_tokens:
                decoder = decoders.setdefault(view.tokenizer, Decoder(view.tokenizer))
                sample["segments"] = decoder.segments(row["input_ids"], row["loss_mask"], row["versions"])
            samples.append(sample)
    if total > len(samples):
        notes.append(f"showing {len(samples)} of {total} samples (--limit {limit}); summaries cover all")
    notes.extend(d.note for d in decoders.values() if d.note)
    return samples, notes


class Decoder:
    """Token ids → text segments with the shard's tokenizer; token ids alone if it cannot be loaded."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer: Any = None
        self.note = ""
        if not tokenizer_path or not Path(tokenizer_path).exists():
            self.note = (f"tokenizer {tokenizer_path or '(none named in the shard metadata)'} not found: "
                         "showing token ids instead of text")  # fmt: skip
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
                out.append({"sampled": bool(mask[start]), "version": versions[start] if mask[start] else None,
                            "ids": chunk, "text": text})  # fmt: skip
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


# -- rendering ----------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def version_switch(previous: dict[str, Any] | None, segment: dict[str, Any]) -> str:
    """The marker shown where a turn's sampled tokens change weight version (a request paused across a
    weight update, `inference.update_mode: interrupt`); "" elsewhere."""
    if previous is None or not (previous["sampled"] and segment["sampled"]):
        return ""
    if previous["version"] == segment["version"]:
        return ""
    return f"⟨v{previous['version']}→v{segment['version']}⟩"


def _versions(sample: dict[str, Any]) -> str:
    lo, hi = sample["min_version"], sample["max_version"]
    return "-" if lo < 0 else (str(lo) if lo == hi else f"{lo}-{hi}")


SUMMARY_COLUMNS = [
    ("step", "step"), ("samples", "count"), ("sessions", "sessions"), ("groups", "groups"),
    ("reward mean", "reward_mean"), ("reward std", "reward_std"), ("len p50", "length_p50"),
    ("len p90", "length_p90"), ("len max", "length_max"), ("sampled tok", "sampled_tokens"),
    ("staleness max", "staleness_max"), ("prefix breaks", "prefix_breaks"),
]  # fmt: skip
SAMPLE_COLUMNS = [
    ("step", "step"), ("session", "session_id"), ("group", "group_id"), ("sample", "sample_id"),
    ("turns", "num_turns"), ("tokens", "tokens"), ("sampled", "sampled_tokens"), ("reward", "reward"),
    ("finish", "finish_reason"),
]  # fmt: skip


def _sample_cells(sample: dict[str, Any]) -> list[str]:
    return [_fmt(sample[key]) for _, key in SAMPLE_COLUMNS] + [_versions(sample)]


def render_rich(views: list[StepView], samples: list[dict[str, Any]], notes: list[str], *, decode: bool) -> None:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from pipeline.console import people_console

    console = people_console(pipe_width=160)
    summary = Table(title="per-step summary", title_justify="left")
    for title, _ in SUMMARY_COLUMNS:
        summary.add_column(title, justify="right")
    for view in views:
        summary.add_row(*[Text(_fmt(view.summary[key])) for _, key in SUMMARY_COLUMNS])
    console.print(summary)
    table = Table(title="samples", title_justify="left")
    for title, _ in SAMPLE_COLUMNS:
        table.add_column(title, overflow="fold")
    table.add_column("versions")
    for sample in samples:
        table.add_row(*[Text(cell) for cell in _sample_cells(sample)])  # Text: ids may hold [markup]
    console.print(table)
    plain = console.no_color or not console.is_terminal
    for sample in samples if decode else []:
        text = Text()
        previous: dict[str, Any] | None = None
        for seg in sample.get("segments", []):
            body = seg["text"] if seg["text"] is not None else " ".join(map(str, seg["ids"])) + " "
            swap = version_switch(previous, seg)
            previous = seg
            if swap:
                text.append(swap, style="bold magenta")
            if seg["sampled"]:
                text.append(f"{SAMPLED_OPEN}{body}{SAMPLED_CLOSE}" if plain else body, style="bold green")
            else:
                text.append(body, style="dim")
        title = f"{sample['sample_id']} · reward {_fmt(sample['reward'])} · {sample['num_turns']} turn(s)"
        legend = f"sampled = green{' «…»' if plain else ''}, prompt = dim, ⟨vA→vB⟩ = new weights mid-turn"
        console.print(Panel(text, title=Text(title), subtitle=Text(legend)))
    for note in notes:
        console.print(f"note: {note}", style="yellow", markup=False, highlight=False)


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;background:#fafafa}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#eee}td.l{text-align:left}pre{white-space:pre-wrap;background:#fff;border:1px solid #ddd;padding:.8em}
.sampled{background:#d4f7d4;color:#064;font-weight:600}.swap{color:#a0a;font-weight:700}.prompt{color:#777}.note{color:#a60}
details{margin:.5em 0}summary{cursor:pointer}
"""


def render_html(source: str, views: list[StepView], samples: list[dict[str, Any]], notes: list[str]) -> str:
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>arl inspect {esc(source)}</title>",
             f"<style>{_CSS}</style></head><body><h1>arl inspect</h1><p>{esc(source)}</p><h2>Per-step summary</h2>",
             "<table><tr>" + "".join(f"<th>{esc(t)}</th>" for t, _ in SUMMARY_COLUMNS) + "</tr>"]  # fmt: skip
    for view in views:
        parts.append("<tr>" + "".join(f"<td>{esc(_fmt(view.summary[k]))}</td>" for _, k in SUMMARY_COLUMNS) + "</tr>")
    parts.append("</table><h2>Samples</h2><table><tr>")
    parts.append("".join(f"<th>{esc(t)}</th>" for t, _ in SAMPLE_COLUMNS) + "<th>versions</th></tr>")
    for sample in samples:
        parts.append("<tr>" + "".join(f"<td class='l'>{esc(c)}</td>" for c in _sample_cells(sample)) + "</tr>")
    parts.append("</table>")
    for sample in samples:
        if "segments" not in sample:
            continue
        spans = []
        previous: dict[str, Any] | None = None
        for seg in sample["segments"]:
            body = seg["text"] if seg["text"] is not None else " ".join(map(str, seg["ids"])) + " "
            swap = version_switch(previous, seg)
            previous = seg
            if swap:
                spans.append(f"<span class='swap' title='the weights changed inside this turn'>{esc(swap)}</span>")
            sampled = seg["sampled"]
            cls, tip = ("sampled", f"sampled, version {seg['version']}") if sampled else ("prompt", "not sampled")
            spans.append(f"<span class='{cls}' title='{tip}'>{esc(body)}</span>")
        head = f"{sample['sample_id']} · reward {_fmt(sample['reward'])} · {sample['num_turns']} turn(s)"
        parts.append(f"<details open><summary>{esc(head)}</summary><pre>{''.join(spans)}</pre></details>")
    parts.extend(f"<p class='note'>note: {esc(n)}</p>" for n in notes)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _slug(path: Path) -> str:
    name = path.resolve().name or "arl"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).removesuffix(".parquet")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    return str(value)
