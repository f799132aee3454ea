"""`arl inspect` as a subprocess on real shards (tiny tokenizer, session trees, write_step)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.proxy.trajectory import Interaction, SessionTree
from pipeline.run.paths import RunPaths
from pipeline.run.shards import write_step
from schemas.trajectory import rows_from_dicts

REPO = Path(__file__).resolve().parents[2]
ARL = REPO / ".venv" / "bin" / "arl"
ANSWER = "The answer is four."


def arl(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "COLUMNS")}
    full_env.update(env or {})
    return subprocess.run([str(ARL), "inspect", *args], capture_output=True, text=True, timeout=120, env=full_env,
                          cwd=cwd or REPO)  # fmt: skip


def session(tokenizer, sid: str, group: str, reward: float, *, edit: bool = False, swap: bool = False) -> SessionTree:  # type: ignore[no-untyped-def]
    """Two turns of a chat, token-exact; `edit` makes the agent rewrite its history (a prefix break); `swap`:
    new weights arrived after the second turn's first 3 tokens (a partial rollout)."""
    messages = [{"role": "user", "content": "What is two plus two?"}]
    prompt1 = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p1 = tokenizer.encode(prompt1, add_special_tokens=False)
    o1 = tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    suffix = tokenizer.encode("\n<|im_start|>user\nAnd three?<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)  # fmt: skip
    p2 = ([*p1, *o1] if not edit else tokenizer.encode("edited history", add_special_tokens=False)) + suffix
    o2 = tokenizer.encode("Five, I think.<|im_end|>", add_special_tokens=False)
    turns = [(iid, prompt, out, [-0.25] * len(out), [version] * 3 + [version + (swap and iid == "b")] * (len(out) - 3))
             for iid, prompt, out, version in (("a", p1, o1, 0), ("b", p2, o2, 1))]  # fmt: skip
    return chained_session(sid, group, {"index": 3}, reward, turns)


def chained_session(sid: str, group: str, metadata: dict, reward: float,
                    turns: list[tuple[str, list[int], list[int], list[float], list[int]]]) -> SessionTree:  # fmt: skip
    """A session whose turns (id, prompt, output, log-probs, versions) each continue the one before."""
    tree = SessionTree(sid, group, metadata=metadata)
    parent = None
    for iid, prompt, out, logprobs, versions in turns:
        tree.add(Interaction(id=f"{sid}-{iid}", session_id=sid, prompt_ids=prompt, output_ids=out,
                             output_logprobs=logprobs, output_versions=versions, parent_id=parent,
                             created_at=1.8e9))  # fmt: skip
        parent = f"{sid}-{iid}"
    tree.set_reward(reward)
    return tree


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> RunPaths:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    paths = RunPaths(tmp_path_factory.mktemp("inspect") / "exp" / "trial")
    for step in (1, 2):
        rows = []
        for i in range(3):
            tree = session(tokenizer, f"s{step}{i}", f"g{step}", reward=float(i), edit=(step == 2 and i == 0),
                           swap=(step == 1 and i == 1))  # fmt: skip
            rows += tree.export("concat", 1.0, step=step)
        write_step(paths, step, rows, producer="rollout", tokenizer=str(tiny_model_dir), rows_per_part=2)
    return paths


def test_table_on_a_run_dir(run_dir: RunPaths) -> None:
    result = arl(str(run_dir.root))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "per-step summary" in out and "samples" in out
    for sid in ("s10", "s12", "s20", "s22"):
        assert sid in out
    # Summary rows: step 1 has 3 samples; step 2 has 4 (session s20 is split by its prefix break).
    assert re.search(r"│\s+1 │\s+3 │\s+3 │", out) and re.search(r"│\s+2 │\s+4 │\s+3 │", out), out


def test_decode_marks_sampled_tokens(run_dir: RunPaths) -> None:
    plain = arl(str(run_dir.step_dir(1)), "--decode")
    assert plain.returncode == 0, plain.stderr
    # Not a terminal: no colour, so sampled text is bracketed; prompt text is shown as is.
    assert f"«{ANSWER}<|im_end|>»" in plain.stdout and "«Five, I think.<|im_end|>»" in plain.stdout
    assert "What is two plus two?" in plain.stdout and "«What" not in plain.stdout
    # s11's second turn changed weights after 3 tokens: marked inside the turn, and only there.
    assert plain.stdout.count("⟨v1→v2⟩") == 1, plain.stdout
    colour = arl(str(run_dir.step_dir(1)), "--decode", env={"FORCE_COLOR": "1", "COLUMNS": "200"})
    assert colour.returncode == 0, colour.stderr
    assert "\x1b[1;32m" in colour.stdout and "«" not in colour.stdout
    assert "\x1b[2m" in colour.stdout  # prompt tokens dim


def test_json_on_a_part_file_and_a_step_filter(run_dir: RunPaths) -> None:
    part = run_dir.step_dir(2) / "part-rollout-00000.parquet"
    result = arl(str(part), "--format", "json", "--decode")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [s["sample_id"] for s in data["samples"]] == ["s20-a", "s20-b"]  # the break splits session s20
    assert data["samples"][1]["metadata"]["prefix_break"] is True
    segments = data["samples"][0]["segments"]
    assert [seg["sampled"] for seg in segments] == [False, True]
    assert segments[1]["text"] == ANSWER + "<|im_end|>" and segments[1]["version"] == 0
    (summary,) = data["steps"]
    assert summary["step"] == 2 and summary["count"] == 2 and summary["prefix_breaks"] == 1

    run = arl(str(run_dir.root), "--format", "json", "--step", "1")
    data = json.loads(run.stdout)
    assert [s["step"] for s in data["steps"]] == [1]
    (summary,) = data["steps"]
    assert summary["count"] == 3 and summary["reward_mean"] == pytest.approx(1.0)
    assert summary["staleness_max"] == 1 and summary["min_version"] == 0
    assert [s["num_turns"] for s in data["samples"]] == [2, 2, 2]
    assert all("segments" not in s for s in data["samples"])


def test_limit_keeps_summaries_whole(run_dir: RunPaths) -> None:
    data = json.loads(arl(str(run_dir.root), "--format", "json", "--limit", "2").stdout)
    assert len(data["samples"]) == 2 and [s["count"] for s in data["steps"]] == [3, 4]
    assert any("showing 2 of 7" in note for note in data["notes"])


def test_html_is_one_self_contained_page_per_step(run_dir: RunPaths, tmp_path: Path) -> None:
    """What the page holds; tests/e2e/test_inspect_viewer.py opens it in a browser."""
    target = tmp_path / "out"
    result = arl(str(run_dir.root), "--format", "html", "-o", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(target / "index.html"), f"2 step pages: {target}/step_*.html"]
    page = (target / "step_000001.html").read_text()
    assert "answer" in page and "\\u003c|im_end|>" in page  # each token's text in the JSON block, `<` escaped
    assert '"prev":null,"next":"step_000002.html","index":"index.html"' in page
    for external in ("<link", "src=", "http://", "https://"):
        assert external not in page
    assert "step_000002.html" in (target / "index.html").read_text()
    one = arl(str(run_dir.root), "--format", "html", "--step", "2", "-o", str(tmp_path / "two.html"))
    assert one.stdout.strip() == str(tmp_path / "two.html") and (tmp_path / "two.html").exists()
    both = arl(str(run_dir.root), "--format", "html", "-o", str(tmp_path / "both.html"))
    assert both.returncode == 2 and "--output must be a directory" in both.stderr
    default = arl(str(run_dir.step_dir(1)), "--format", "html", cwd=tmp_path)
    assert default.returncode == 0 and Path(default.stdout.strip()).exists()


def test_missing_tokenizer_falls_back_to_ids(tmp_path: Path, run_dir: RunPaths) -> None:
    from pipeline.run.shards import read_step

    paths = RunPaths(tmp_path / "run")
    table = read_step(run_dir, 1).to_pylist()
    write_step(paths, 1, rows_from_dicts(table), producer="rollout", tokenizer="/nonexistent/tokenizer")
    result = arl(str(paths.root), "--decode")
    assert result.returncode == 0, result.stderr
    assert "tokenizer /nonexistent/tokenizer not found" in result.stdout.replace("\n", "")


@pytest.mark.parametrize(
    "case", ["missing", "not-shards", "corrupt-part", "junk-parquet", "incomplete-step", "bad-manifest", "other-file"]
)
def test_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, run_dir: RunPaths) -> None:
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "not-shards":
        target = tmp_path / "empty"
        target.mkdir()
    elif case == "corrupt-part":
        step_dir = tmp_path / "step_000001"
        step_dir.mkdir()
        for f in run_dir.step_dir(1).iterdir():
            (step_dir / f.name).write_bytes(f.read_bytes())
        victim = step_dir / "part-rollout-00001.parquet"
        data = bytearray(victim.read_bytes())
        data[100] ^= 0x55
        victim.write_bytes(bytes(data))
        target = step_dir
    elif case == "bad-manifest":
        step_dir = tmp_path / "step_000001"
        step_dir.mkdir()
        (step_dir / "part-rollout-00000.parquet").write_bytes(
            (run_dir.step_dir(1) / "part-rollout-00000.parquet").read_bytes()
        )
        (step_dir / "_MANIFEST.json").write_text("{not json")
        target = step_dir / "part-rollout-00000.parquet"
    elif case == "other-file":
        target = tmp_path / "notes.txt"
        target.write_text("hello")
    elif case == "junk-parquet":
        target = tmp_path / "junk.parquet"
        target.write_bytes(b"this is not parquet at all")
    else:
        target = tmp_path / "trajectories" / "step_000005"
        target.mkdir(parents=True)
    result = arl(str(target))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    if case == "corrupt-part":
        assert "part-rollout-00001.parquet: sha256" in lines[0]
