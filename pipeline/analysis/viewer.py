"""The trajectory viewer: `arl inspect --format html`, one self-contained page per step.

Each page is `pipeline/templates/inspect_viewer.html` (inline CSS and JS, nothing fetched) with the
step's data as one JSON block: per sample its tokens (id, decoded text, behaviour log-prob, weight
version, loss mask), the tool-call / reasoning / tool-response spans and turn headers found in the
rendered chat template, and, when a replay file is given or found, each token's trainer log-prob and
|delta|. The page's script draws the token spans (coloured by log-prob or by mismatch), the hover
card and the filters; docs/inspect.md ("The trajectory viewer") describes what a person sees.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_right
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.analysis.step_views import Decoder, InspectError, StepView, advantages, json_default, only_task, read_full
from pipeline.run.paths import RunPaths, parse_step_name, step_name
from pipeline.run.shards import row_metadata
from schemas.config.rollout import task_of

TEMPLATE = "inspect_viewer.html"
REPLAY_COLUMNS = ("run", "step", "sample_id", "pos", "token_id", "engine_logprob", "trainer_logprob", "delta")
"""What `arl replay` writes; the viewer needs `sample_id`, `pos` and `delta` (or both log-probs), the rest is used
when present (`step` to split a file of several steps, `token_id` to check the file belongs to these shards)."""

MARKERS = (
    ("think", re.compile(r"<think>"), re.compile(r"</think>")),
    ("call", re.compile(r"<tool_call>"), re.compile(r"</tool_call>")),
    ("call", re.compile(r"<\|python_tag\|>"), re.compile(r"<\|eom_id\|>|<\|eot_id\|>")),
    ("resp", re.compile(r"<tool_response>"), re.compile(r"</tool_response>")),
)
"""(kind, opening, closing) in the decoded text: Qwen/Hermes reasoning and tool markup, Llama 3's python tag.
An opening never closed (a completion cut at max tokens) runs to the end of the sample."""
TURN_HEADER = re.compile(r"<\|im_start\|>(\w+)|<\|start_header_id\|>(\w+)<\|end_header_id\|>")
"""Where a chat turn begins and whose it is (ChatML and Llama 3 templates)."""


def write_pages(
    source: Path, views: list[StepView], *, output: Path | None, limit: int, mismatch: Path | None, task: str | None
) -> list[str]:
    """Write one page per step (and an index for several); returns the lines to print (the paths)."""
    pages, index = _targets(source, views, output)
    replay = read_mismatch(mismatch) if mismatch is not None else None
    decoders: dict[str, Decoder] = {}
    for i, (view, page) in enumerate(zip(views, pages, strict=True)):
        full = read_full(view)
        if task is not None:
            (full,) = only_task([full], task, source)
        decoder = decoders.setdefault(full.tokenizer, Decoder(full.tokenizer))
        deltas, replay_note = _step_mismatch(replay, mismatch, source, full)
        nav = {
            "prev": pages[i - 1].name if i else None,
            "next": pages[i + 1].name if i + 1 < len(pages) else None,
            "index": index.name if index else None,
        }
        data = page_data(str(source), view, full, decoder, deltas, limit=limit, nav=nav)
        data["notes"] += [n for n in (decoder.note, replay_note) if n]
        _write(page, render_page(data))
    if index is None:
        return [str(pages[0])]
    _write(
        index,
        render_page(
            {
                "index": True,
                "source": str(source),
                "title": f"arl inspect · {source}",
                "steps": [{**v.summary, "page": p.name} for v, p in zip(views, pages, strict=True)],
                "notes": [],
            }
        ),
    )
    return [str(index), f"{len(pages)} step pages: {index.parent}/step_*.html"]


def _targets(source: Path, views: list[StepView], output: Path | None) -> tuple[list[Path], Path | None]:
    """A `.html` --output is the page of the one step shown; any other --output (default `./<name>.inspect/`)
    is a directory of `step_NNNNNN.html` pages plus `index.html` when there are several."""
    if output is not None and output.suffix == ".html":
        if len(views) > 1:
            raise InspectError(
                f"{len(views)} steps make {len(views)} pages: --output must be a directory "
                f"(not {output}), or pick one step with --step"
            )
        return [output], None
    folder = output if output is not None else Path.cwd() / f"{_slug(source)}.inspect"
    pages = [folder / f"{step_name(v.step)}.html" for v in views]
    return pages, (folder / "index.html" if len(views) > 1 else None)


def page_data(
    source: str,
    view: StepView,
    full: StepView,
    decoder: Decoder,
    deltas: dict[str, dict[int, Any]],
    *,
    limit: int,
    nav: dict[str, str | None],
) -> dict[str, Any]:
    """Everything one step's page shows, as the JSON its script reads."""
    table = full.table.slice(0, limit)
    rows = table.to_pylist()
    credit = advantages(full)
    samples = [sample_data(row, i, decoder, deltas.get(row["sample_id"], {}), credit[i]) for i, row in enumerate(rows)]
    notes = []
    if full.table.num_rows > len(samples):
        notes.append(f"showing the first {len(samples)} of {full.table.num_rows} samples (--limit {limit})")
    bad = sum(s.pop("token_mismatch", 0) for s in samples)
    if bad:
        notes.append(
            f"{bad} replay rows name another token than the shard at their position: is the replay file from this run?"
        )
    return {
        "index": False,
        "source": source,
        "step": view.step,
        "title": f"arl inspect · step {view.step} · {source}",
        "summary": view.summary,
        "samples": samples,
        "nav": nav,
        "notes": notes,
        "has_mismatch": any(s["d"] is not None for s in samples),
        "tokenizer": full.tokenizer,
    }


def sample_data(
    row: dict[str, Any], index: int, decoder: Decoder, replay: dict[int, Any], advantage: float = 0.0
) -> dict[str, Any]:
    ids, mask = row["input_ids"], row["loss_mask"]
    texts = token_texts(decoder, ids)
    metadata = row_metadata(row["metadata"], index)
    sampled_versions = sorted({v for v, m in zip(row["versions"], mask, strict=True) if m})
    out: dict[str, Any] = {
        "id": row["sample_id"],
        "session": row["session_id"],
        "group": row["group_id"],
        "parent": row["parent_id"],
        "task": task_of(metadata),
        "reward": _num(row["reward"]),
        "adv": _num(advantage),
        "finish": row["finish_reason"],
        "turns": row["num_turns"],
        "len": len(ids),
        "sampled": int(sum(mask)),
        "versions": sampled_versions,
        "prefix_break": bool(metadata.get("prefix_break")),
        "metadata": metadata,
        "ids": ids,
        "t": texts,
        "m": "".join("1" if m else "0" for m in mask),
        "v": row["versions"],
        "lp": [round(float(x), 4) for x in row["logprobs"]],
        "d": None,
        "tl": None,
    }
    out["marks"], out["headers"] = find_marks(texts) if texts is not None else ([], [])
    out["calls"] = tool_calls(metadata, out["marks"], out["m"])
    if replay:
        out["d"] = [_num(abs(replay[p][0])) if p in replay else None for p in range(len(ids))]
        out["tl"] = [_num(replay[p][1]) if p in replay else None for p in range(len(ids))]
        out["token_mismatch"] = sum(
            1 for p, (_, _, tid) in replay.items() if tid is not None and (p >= len(ids) or ids[p] != tid)
        )
    return out


def token_texts(decoder: Decoder, ids: list[int]) -> list[str] | None:
    """Each token's own text, or None without a tokenizer. A byte-level BPE token can hold half a UTF-8
    character (decoded alone: U+FFFD); such a run is decoded together and its text given to its last token."""
    tok = decoder.tokenizer
    if tok is None:
        return None
    batch = getattr(tok, "decode_batch", None) or tok.batch_decode
    singles = batch([[i] for i in ids], skip_special_tokens=False)
    out: list[str] = []
    i = 0
    while i < len(ids):
        if "\ufffd" not in singles[i]:
            out.append(singles[i])
            i += 1
            continue
        end, text = i + 1, singles[i]
        while end < min(len(ids), i + 4) and text.endswith("\ufffd"):  # UTF-8 needs at most 4 bytes
            end += 1
            text = tok.decode(ids[i:end], skip_special_tokens=False)
        out.extend([""] * (end - i - 1) + [text])
        i = end
    return out


def tool_calls(metadata: dict[str, Any], marks: list[list[Any]], mask: str) -> int:
    """The sample's tool calls: the ones the proxy's parser accepted (`parsed_tool_calls`). Shards written before
    that count existed: the call markup that starts on a sampled token (the chat template's own instructions in
    the prompt are not calls)."""
    if "parsed_tool_calls" in metadata:
        return int(metadata["parsed_tool_calls"])
    return sum(1 for first, _, kind in marks if kind == "call" and mask[first] == "1")


def find_marks(texts: list[str]) -> tuple[list[list[Any]], list[list[Any]]]:
    """([first token, last token, kind], ...) of reasoning / tool call / tool response spans, and
    ([token, role], ...) where each chat turn's header starts, found in the decoded text."""
    starts = np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist() if texts else []
    text = "".join(texts)

    def token_at(char: int) -> int:
        return max(0, bisect_right(starts, char) - 1)

    marks: list[list[Any]] = []
    for kind, opening, closing in MARKERS:
        for match in opening.finditer(text):
            close = closing.search(text, match.end())
            end = close.end() if close else len(text)
            marks.append([token_at(match.start()), token_at(max(match.start(), end - 1)), kind])
    headers = [[token_at(m.start()), m.group(1) or m.group(2)] for m in TURN_HEADER.finditer(text)]
    return sorted(marks), headers


# -- replay (mismatch) ---------------------------------------------------------------------------
def read_mismatch(path: Path) -> dict[tuple[int | None, str], dict[int, tuple[float, float | None, int | None]]]:
    """(step or None, sample_id) -> {pos: (delta, trainer_logprob, token_id)} from an `arl replay` Parquet file."""
    if not path.is_file():
        raise InspectError(f"--mismatch {path}: no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InspectError(f"--mismatch {path}: not a Parquet file ({exc})") from None
    names = set(table.column_names)
    missing = [c for c in ("sample_id", "pos") if c not in names]
    if "delta" not in names and not {"engine_logprob", "trainer_logprob"} <= names:
        missing.append("delta (or engine_logprob and trainer_logprob)")
    if missing:
        has, expected = ", ".join(sorted(names)) or "none", ", ".join(REPLAY_COLUMNS)
        raise InspectError(
            f"--mismatch {path}: missing column(s) {', '.join(missing)}; it has {has} (arl replay writes {expected})"
        )

    def column(name: str) -> list[Any]:
        return table.column(name).to_pylist() if name in names else [None] * table.num_rows

    trainer, engine = column("trainer_logprob"), column("engine_logprob")
    deltas = column("delta") if "delta" in names else [t - e for t, e in zip(trainer, engine, strict=True)]
    out: dict[tuple[int | None, str], dict[int, tuple[float, float | None, int | None]]] = {}
    for step, sid, pos, delta, tl, tid in zip(
        column("step"), column("sample_id"), column("pos"), deltas, trainer, column("token_id"), strict=True
    ):
        if delta is not None and sid is not None and pos is not None:
            out.setdefault((step, str(sid)), {})[int(pos)] = (float(delta), tl, tid)
    return out


def _step_mismatch(replay: Any, given: Path | None, source: Path, view: StepView) -> tuple[dict[str, Any], str]:
    """One step's replay rows by sample id: from --mismatch, or from the run's own replay file when it exists."""
    note = ""
    if replay is None:
        default = _default_replay(source, view.step)
        if default is None or not default.is_file():
            return {}, ""
        replay, given = read_mismatch(default), default
        note = f"token mismatch from {default}"
    by_sample = {sid: rows for (step, sid), rows in replay.items() if step is None or step == view.step}
    if not by_sample:
        note = f"{given} has no row of step {view.step}: colouring by log-prob"
    return by_sample, note


def _default_replay(source: Path, step: int) -> Path | None:
    """`<run>/replay/step_NNNNNN.parquet` when `source` is a run dir or one of its step dirs."""
    source = source.resolve()
    if source.is_file():
        source = source.parent
    if parse_step_name(source.name) is not None and source.parent.name == "trajectories":
        return RunPaths(source.parent.parent).replay_file(step)
    if (source / "trajectories").is_dir():
        return RunPaths(source).replay_file(step)
    return None


# -- output --------------------------------------------------------------------------------------
def render_page(data: dict[str, Any]) -> str:
    """The template with `data` as its JSON block (`<` escaped, so no text in a sample can end the script)."""
    template = resources.files("pipeline.templates").joinpath(TEMPLATE).read_text()
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=json_default)
    blob = blob.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    from html import escape

    return template.replace("__ARL_TITLE__", escape(data["title"])).replace("__ARL_DATA__", blob)


def _write(path: Path, text: str) -> None:
    from pipeline.run.handoff import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def _slug(path: Path) -> str:
    name = path.resolve().name or "arl"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).removesuffix(".parquet")


def _num(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None
