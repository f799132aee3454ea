"""`arl inspect PATH`: an offline look at trajectory shards (a part file, a step dir or a run dir).

Shows a table of samples and a per-step summary; `--decode` renders each row's turns with the
tokenizer named in the shard metadata, sampled tokens styled apart from prompt/tool tokens.
`--format json` is for scripts; `--format html` writes the trajectory viewer, one self-contained page per
step (`pipeline.analysis.viewer`). Loading and decoding: `pipeline.analysis.step_views`.

Every failure is an `ArlError` (printed by the CLI as one `error: ...` line, exit code 2): a
person pointing this at the wrong path wants to know why in one line, not a traceback.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from pipeline.analysis.step_views import (
    Decoder,
    InspectError,
    StepView,
    advantages,
    json_default,
    load_views,
    only_task,
)
from pipeline.run.shards import per_row_sampled_and_versions, row_metadata, step_stats

FORMATS = ("table", "json", "html")
LIMIT = 50
"""Samples listed by the table and JSON formats unless --limit says otherwise."""
HTML_LIMIT = 500
"""Samples per step page of the viewer unless --limit says otherwise (a page holds every token of each)."""
SAMPLED_OPEN, SAMPLED_CLOSE = "«", "»"
"""Brackets around sampled text where colour is unavailable (a pipe, NO_COLOR): still visibly different."""


def inspect_path(
    path: Path,
    *,
    step: int | None = None,
    decode: bool = False,
    fmt: str = "table",
    output: Path | None = None,
    limit: int | None = None,
    task: str | None = None,
    mismatch: Path | None = None,
) -> int:
    """Show the shards under `path`; returns the exit code (0)."""
    if fmt not in FORMATS:
        raise InspectError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if limit is not None and limit < 0:
        raise InspectError(f"--limit must be >= 0, got {limit}")
    if mismatch is not None and fmt != "html":
        raise InspectError("--mismatch colours the viewer's tokens: use it with --format html")
    html = fmt == "html"
    if mismatch is not None:  # a wrong replay file is reported before any step is read
        from pipeline.analysis.viewer import read_mismatch

        read_mismatch(mismatch)
    # The viewer reads each step's tokens when it writes that step's page, never all steps at once.
    views = load_views(Path(path), step=step, with_tokens=decode and not html, limit=limit or LIMIT)
    if task is not None:
        views = only_task(views, task, path)
    for view in views:
        view.summary = step_stats(view.table, view.step)
    if html:
        from pipeline.analysis.viewer import write_pages

        for line in write_pages(
            Path(path), views, output=output, limit=HTML_LIMIT if limit is None else limit, mismatch=mismatch, task=task
        ):
            print(line)
        return 0
    samples, notes = collect_samples(views, decode=decode, limit=LIMIT if limit is None else limit)
    if fmt == "json":
        payload = {"source": str(path), "steps": [v.summary for v in views], "samples": samples, "notes": notes}
        sys.stdout.write(json.dumps(payload, indent=2, default=json_default) + "\n")
    else:
        render_rich(views, samples, notes, decode=decode)
    return 0


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
        credit = advantages(view)
        lengths, sampled, vmin, vmax = per_row_sampled_and_versions(table)
        has_tokens = "input_ids" in table.column_names
        for i, row in enumerate(table.to_pylist()):
            sample = {
                "step": row["step"],
                "session_id": row["session_id"],
                "sample_id": row["sample_id"],
                "parent_id": row["parent_id"],
                "group_id": row["group_id"],
                "num_turns": row["num_turns"],
                "tokens": int(lengths[i]),
                "sampled_tokens": int(sampled[i]),
                "prompt_len": row["prompt_len"],
                "reward": row["reward"],
                "advantage": credit[i],
                "finish_reason": row["finish_reason"],
                "min_version": int(vmin[i]),
                "max_version": int(vmax[i]),
                "metadata": row_metadata(row["metadata"], i),
            }
            if decode and has_tokens:
                decoder = decoders.setdefault(view.tokenizer, Decoder(view.tokenizer))
                sample["segments"] = number_turns(decoder.segments(row["input_ids"], row["loss_mask"], row["versions"]))
            samples.append(sample)
    if total > len(samples):
        notes.append(f"showing {len(samples)} of {total} samples (--limit {limit}); summaries cover all")
    notes.extend(d.note for d in decoders.values() if d.note)
    return samples, notes


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
    ("step", "step"),
    ("samples", "count"),
    ("sessions", "sessions"),
    ("groups", "groups"),
    ("reward mean", "reward_mean"),
    ("reward std", "reward_std"),
    ("len p50", "length_p50"),
    ("len p90", "length_p90"),
    ("len max", "length_max"),
    ("sampled tok", "sampled_tokens"),
    ("staleness max", "staleness_max"),
    ("prefix breaks", "prefix_breaks"),
]
SAMPLE_COLUMNS = [
    ("step", "step"),
    ("session", "session_id"),
    ("group", "group_id"),
    ("sample", "sample_id"),
    ("turns", "num_turns"),
    ("tokens", "tokens"),
    ("sampled", "sampled_tokens"),
    ("reward", "reward"),
    ("finish", "finish_reason"),
]


def _sample_cells(sample: dict[str, Any]) -> list[str]:
    return [_fmt(sample[key]) for _, key in SAMPLE_COLUMNS] + [_versions(sample)]


def number_turns(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sampled segment gets `turn` (1, 2, ...: a turn is a run of sampled tokens, whatever weight versions it
    spans); prompt and tool segments get None."""
    turn, previous_sampled = 0, False
    for seg in segments:
        if seg["sampled"] and not previous_sampled:
            turn += 1
        seg["turn"] = turn if seg["sampled"] else None
        previous_sampled = seg["sampled"]
    return segments


def render_rich(views: list[StepView], samples: list[dict[str, Any]], notes: list[str], *, decode: bool) -> None:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from pipeline.run.console import people_console

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
            if seg["sampled"] and not (previous or {}).get("sampled"):  # a turn starts: what it is trained with
                text.append(f"⟨turn {seg['turn']} · advantage {sample['advantage']:+.2f}⟩", style="bold cyan")
            previous = seg
            if swap:
                text.append(swap, style="bold magenta")
            if seg["sampled"]:
                text.append(f"{SAMPLED_OPEN}{body}{SAMPLED_CLOSE}" if plain else body, style="bold green")
            else:
                text.append(body, style="dim")
        title = (
            f"{sample['sample_id']} · reward {_fmt(sample['reward'])} · advantage {sample['advantage']:+.3f} · "
            f"{sample['num_turns']} turn(s)"
        )
        legend = (
            f"sampled = green{' «…»' if plain else ''}, prompt = dim, ⟨vA→vB⟩ = new weights mid-turn, "
            "⟨turn k · advantage⟩ = what the turn's tokens are trained with"
        )
        console.print(Panel(text, title=Text(title), subtitle=Text(legend)))
    for note in notes:
        console.print(f"note: {note}", style="yellow", markup=False, highlight=False)
