"""`arl query`: real shards written by `write_step`, real DuckDB, the real CLI (typer's CliRunner).

Two runs share one module-scoped directory: `exp_a/trial0` (steps 0-2 complete; step 3 torn: parts
without a manifest; step 4 corrupt: a part whose bytes no longer match its checksum; a writer's staging
dir) and `lr=0.1/trial0` (steps 0-1; its path holds `key=value`, which must not become a column). Every
expected figure is computed in Python from `read_step`, never from DuckDB.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.analysis.query import connect
from pipeline.analysis.query.output import emit
from pipeline.cli import app
from pipeline.errors import ArlError
from pipeline.run.paths import MANIFEST, RunPaths
from pipeline.run.shards import read_step, write_step
from pipeline.run.sinks import JsonlSink
from schemas.trajectory import SCHEMA, rows_from_dicts

DOC = Path(__file__).resolve().parents[2] / "docs" / "inspect.md"
GOOD_STEPS = {"exp_a/trial0": [0, 1, 2], "lr=0.1/trial0": [0, 1]}
SAMPLES_PER_STEP = 14


def make_dicts(step: int, seed: int) -> list[dict[str, Any]]:
    """Valid rows of 1-3 turns, 20-900 tokens: some stale, some sampled across a weight update, some after a
    prefix break; groups of 2 whose rewards are sometimes equal."""
    rng = random.Random(seed * 1000 + step)
    rows = []
    for i in range(SAMPLES_PER_STEP):
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        turns = rng.randint(1, 3)
        for turn in range(turns):
            prompt, sampled = rng.randint(5, 400 if turn == 0 else 40), rng.randint(2, 60)
            version = max(step - rng.randint(0, 2), 0)
            swap = version < step and rng.random() < 0.3  # new weights arrived mid-turn
            ids += [rng.randrange(1000) for _ in range(prompt + sampled)]
            mask += [0] * prompt + [1] * sampled
            logprobs += [0.0] * prompt + [-rng.random() for _ in range(sampled)]
            versions += [-1] * prompt + [version + (swap and k >= sampled // 2) for k in range(sampled)]
        rows.append({
            "step": step, "session_id": f"s{step}-{i // 3}", "sample_id": f"x{seed}-{step}-{i}",
            "parent_id": None, "group_id": f"g{step}-{i // 2}", "input_ids": ids, "loss_mask": mask,
            "logprobs": logprobs, "versions": versions, "reward": float(rng.choice([0.0, 0.5, 1.0])),
            "prompt_len": mask.index(1), "num_turns": turns, "finish_reason": rng.choice(["stop", "length"]),
            "created_at": datetime(2026, 11, 22, 12, step, i, tzinfo=UTC),
            "metadata": json.dumps({"index": i, "prefix_break": rng.random() < 0.2}),
        })  # fmt: skip
    return rows


def write_metrics(paths: RunPaths, steps: list[int], seed: int) -> None:
    for step in steps:
        JsonlSink(paths.rollout_metrics).log(step, {"reward_mean": 0.1 * step + seed, "agent/exact_correct": 0.5,
                                                    "staleness_hist": {"0": 3, "1": step}})  # fmt: skip
        JsonlSink(paths.train_metrics).log(step, {"loss": -0.01 * step - seed, "version": step + 1})
    JsonlSink(paths.eval_metrics).log(0, {"version": 0, "set": "repeat-greedy", "pass@1": 0.25 + seed})
    JsonlSink(paths.eval_metrics).log(2, {"version": 2, "set": "repeat-greedy", "pass@1": 0.75 + seed})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[RunPaths]:
    root = tmp_path_factory.mktemp("query")
    a, b = RunPaths(root / "exp_a" / "trial0"), RunPaths(root / "lr=0.1" / "trial0")
    for seed, paths, steps in ((1, a, [0, 1, 2, 3, 4]), (2, b, [0, 1])):
        for step in steps:
            write_step(paths, step, rows_from_dicts(make_dicts(step, seed)), producer="rollout", tokenizer="none",
                       rows_per_part=5)  # fmt: skip
        write_metrics(paths, [s for s in steps if s < 3], seed)
    a.step_manifest(3).unlink()  # torn: the parts are there, the manifest is not
    part = a.step_dir(4) / RunPaths.shard_name("rollout", 1)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # corrupt: same size, one byte flipped
    part.write_bytes(bytes(data))
    staging = a.trajectories / "step_000005.abcd.tmp"
    staging.mkdir()
    (staging / RunPaths.shard_name("rollout", 0)).write_bytes(a.step_dir(0).joinpath(
        RunPaths.shard_name("rollout", 0)).read_bytes())  # fmt: skip
    return [a, b]


@pytest.fixture(scope="module")
def rows(runs: list[RunPaths]) -> list[dict[str, Any]]:
    """Every good row, read back by arl's own reader, with its `run` label."""
    out = []
    for paths, (label, steps) in zip(runs, GOOD_STEPS.items(), strict=True):
        for step in steps:
            out += [{"run": label, **row} for row in read_step(paths, step).to_pylist()]
    return out


def arl_query(*args: str, stdin: str | None = None) -> Any:
    result = CliRunner().invoke(app, ["query", *args], input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def query_json(runs: list[RunPaths], sql: str) -> list[dict[str, Any]]:
    result = arl_query(*(str(r.root) for r in runs), sql, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- the worked queries of docs/inspect.md -------------------------------------------------------
def doc_queries() -> dict[int, str]:
    section = DOC.read_text().split("## SQL over runs: `arl query`", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"\*\*(\d+)\. [^*]+\*\*[^\n]*\n\n```sql\n(.*?)```", section, re.S)
    return {int(number): sql for number, sql in found}


def test_the_doc_has_eight_worked_queries() -> None:
    assert sorted(doc_queries()) == list(range(1, 9))


def sampled_runs(row: dict[str, Any]) -> list[list[int]]:
    """The row's turns: each maximal run of sampled positions."""
    turns: list[list[int]] = []
    for pos, bit in enumerate(row["loss_mask"]):
        if bit and (not pos or not row["loss_mask"][pos - 1]):
            turns.append([])
        if bit:
            turns[-1].append(pos)
    return turns


Rows = list[dict[str, Any]]


def sampled_versions(row: dict[str, Any]) -> list[int]:
    return [v for m, v in zip(row["loss_mask"], row["versions"], strict=True) if m]


def reward_by_length(rows: Rows, runs: list[RunPaths]) -> Rows:
    buckets: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        buckets[len(row["input_ids"]) // 256 * 256].append(row["reward"])
    return [{"length_from": k, "samples": len(v), "reward_mean": sum(v) / len(v)} for k, v in sorted(buckets.items())]


def staleness_histogram(rows: Rows, runs: list[RunPaths]) -> Rows:
    stale = Counter(row["step"] - v for row in rows for v in sampled_versions(row))
    return [{"staleness": k, "tokens": n} for k, n in sorted(stale.items())]


def prefix_break_sessions(rows: Rows, runs: list[RunPaths]) -> Rows:
    broken = Counter((r["run"], r["step"], r["session_id"]) for r in rows if json.loads(r["metadata"])["prefix_break"])
    return [{"run": k[0], "step": k[1], "session_id": k[2], "samples": n} for k, n in sorted(broken.items())]


def tokens_per_turn(rows: Rows, runs: list[RunPaths]) -> Rows:
    per_turn: dict[int, list[int]] = defaultdict(list)
    for row in rows:
        for turn, positions in enumerate(sampled_runs(row), start=1):
            per_turn[turn].append(len(positions))
    return [{"turn": t, "samples": len(v), "sampled_tokens_mean": sum(v) / len(v)} for t, v in sorted(per_turn.items())]


def constant_groups(rows: Rows, runs: list[RunPaths]) -> Rows:
    groups: dict[tuple[str, int], dict[str, set[float]]] = defaultdict(lambda: defaultdict(set))
    for row in rows:
        groups[(row["run"], row["step"])][row["group_id"]].add(row["reward"])
    return [{"run": k[0], "step": k[1], "groups": len(g), "constant_groups": sum(len(r) == 1 for r in g.values())}
            for k, g in sorted(groups.items())]  # fmt: skip


def mixed_versions(rows: Rows, runs: list[RunPaths]) -> Rows:
    mixed = []
    for row in sorted(rows, key=lambda r: (r["run"], r["step"], r["sample_id"])):
        used = sampled_versions(row)
        if min(used) < max(used):
            mixed.append({"run": row["run"], "step": row["step"], "sample_id": row["sample_id"],
                          "first_version": min(used), "last_version": max(used)})  # fmt: skip
    assert mixed, "the fixture must hold partial rollouts"
    return mixed


def learning_curve(rows: Rows, runs: list[RunPaths]) -> Rows:
    out = []
    for paths, label in zip(runs, GOOD_STEPS, strict=True):
        rollout = {r["step"]: r for r in map(json.loads, paths.rollout_metrics.read_text().splitlines())}
        train = {r["step"]: r for r in map(json.loads, paths.train_metrics.read_text().splitlines())}
        evals = {r["version"]: r["pass@1"] for r in map(json.loads, paths.eval_metrics.read_text().splitlines())}
        # an evaluation of a version no step reached (the final one) has a row of its own
        out += [{"run": label, "step": s, "rollout_reward_mean": rollout.get(s, {}).get("reward_mean"),
                 "train_loss": train.get(s, {}).get("loss"), "train_version": train.get(s, {}).get("version"),
                 "eval_repeat_greedy_pass_1": evals.get(s)} for s in sorted(set(rollout) | set(evals))]  # fmt: skip
    return out


def runs_side_by_side(rows: Rows, runs: list[RunPaths]) -> Rows:
    by_run: dict[str, Rows] = defaultdict(list)
    for row in rows:
        by_run[row["run"]].append(row)
    return [{"run": run, "steps": len({r["step"] for r in rs}), "samples": len(rs),
             "sampled_tokens": sum(len(sampled_versions(r)) for r in rs),
             "reward_mean": sum(r["reward"] for r in rs) / len(rs),
             "truncated_share": sum(r["finish_reason"] == "length" for r in rs) / len(rs)}
            for run, rs in sorted(by_run.items())]  # fmt: skip


EXPECTED = {1: reward_by_length, 2: staleness_histogram, 3: prefix_break_sessions, 4: tokens_per_turn,
            5: constant_groups, 6: mixed_versions, 7: learning_curve, 8: runs_side_by_side}  # fmt: skip
"""Worked query number -> its figure computed in Python."""


@pytest.mark.parametrize("number", range(1, 9))
def test_worked_query(number: int, runs: list[RunPaths], rows: list[dict[str, Any]]) -> None:
    got = query_json(runs, doc_queries()[number])
    want = EXPECTED[number](rows, runs)
    assert len(want) > 1, "a check over one row proves little"
    assert got == [pytest.approx(row) for row in want]


# -- what the views hold ------------------------------------------------------------------------
def test_only_verified_complete_steps_appear_and_the_others_are_named(runs: list[RunPaths], rows: list[dict]) -> None:
    result = arl_query(str(runs[0].root), str(runs[1].root), "SELECT run, step, count(*) AS n FROM samples "
                       "GROUP BY ALL ORDER BY ALL", "--format", "json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"run": run, "step": s, "n": SAMPLES_PER_STEP}
                                         for run, steps in GOOD_STEPS.items() for s in steps]  # fmt: skip
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "exp_a/trial0: step 4 left out" in notes[0] and "sha256" in notes[0]
    sql = "SELECT count(*) AS n, count(DISTINCT step) AS steps FROM tokens WHERE run = 'exp_a/trial0'"
    tokens = query_json(runs, sql)
    assert tokens == [{"n": sum(len(r["input_ids"]) for r in rows if r["run"] == "exp_a/trial0"), "steps": 3}]


def test_a_part_the_manifest_lists_but_the_disk_lacks_leaves_its_step_out(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    for step in (0, 1):
        write_step(paths, step, rows_from_dicts(make_dicts(step, 7)), producer="rollout", tokenizer="none",
                   rows_per_part=5)  # fmt: skip
    (paths.step_dir(1) / RunPaths.shard_name("rollout", 2)).unlink()
    catalog = connect([paths.root])
    assert catalog.read_steps == {"run": [0]}
    assert len(catalog.notes) == 1 and "listed in" in catalog.notes[0] and "but missing" in catalog.notes[0]
    assert catalog.connection.sql("SELECT DISTINCT step FROM samples").fetchall() == [(0,)]


def test_views_columns(runs: list[RunPaths]) -> None:
    result = arl_query(str(runs[0].root), "--schema", "--format", "csv")
    assert result.exit_code == 0, result.output
    listed = defaultdict(list)
    for row in csv.DictReader(io.StringIO(result.stdout)):
        listed[row["view"]].append(row["column"])
    assert list(listed) == ["samples", "tokens", "steps"]
    assert listed["samples"] == ["run", *SCHEMA.names, "n_tokens", "n_sampled"]
    assert listed["tokens"] == ["run", "step", "sample_id", "pos", "token_id", "loss_mask", "logprob", "version"]
    assert listed["steps"] == ["run", "step", "rollout_agent_exact_correct", "rollout_reward_mean",
                               "rollout_staleness_hist", "rollout_time", "train_loss", "train_time", "train_version",
                               "eval_repeat_greedy_pass_1"]  # fmt: skip


def test_a_run_without_complete_steps_has_the_same_column_types(runs: list[RunPaths], tmp_path: Path) -> None:
    (tmp_path / "fresh" / "trajectories").mkdir(parents=True)
    empty, full = connect([tmp_path / "fresh"]).connection, connect([runs[1].root]).connection
    for view in ("samples", "tokens"):
        assert empty.sql(f"DESCRIBE {view}").fetchall() == full.sql(f"DESCRIBE {view}").fetchall()
    assert empty.sql("SELECT count(*) FROM samples").fetchall() == [(0,)]
    assert empty.sql("SELECT * FROM steps").columns == ["run", "step"]


def test_no_verify_reads_the_same_rows(runs: list[RunPaths]) -> None:
    sql = "SELECT step, sum(n_tokens) AS t FROM samples GROUP BY step ORDER BY step"
    verified = arl_query(str(runs[1].root), sql, "--format", "json")
    trusted = arl_query(str(runs[1].root), sql, "--format", "json", "--no-verify")
    assert verified.exit_code == trusted.exit_code == 0 and verified.stdout == trusted.stdout


# -- output -------------------------------------------------------------------------------------
SQL = "SELECT run, step, sample_id, reward, input_ids, created_at FROM samples ORDER BY run, step, sample_id"


def test_every_format_to_stdout_and_to_a_file(runs: list[RunPaths], rows: list[dict], tmp_path: Path) -> None:
    want = sorted(rows, key=lambda r: (r["run"], r["step"], r["sample_id"]))
    dirs = [str(r.root) for r in runs]
    parsed: dict[str, list[dict[str, Any]]] = {}
    for fmt in ("csv", "json", "parquet"):
        out = tmp_path / f"result.{fmt}"
        to_file = arl_query(*dirs, SQL, "--format", fmt, "--output", str(out))
        to_stdout = arl_query(*dirs, SQL, "--format", fmt)
        assert to_file.exit_code == to_stdout.exit_code == 0, to_file.output + to_stdout.output
        assert out.read_bytes() == to_stdout.stdout_bytes or fmt == "parquet"
        if fmt == "csv":
            parsed[fmt] = list(csv.DictReader(io.StringIO(out.read_text())))
        elif fmt == "json":
            parsed[fmt] = json.loads(out.read_text())
        else:
            parsed[fmt] = pq.read_table(out).to_pylist()
            assert pq.read_table(io.BytesIO(to_stdout.stdout_bytes)).to_pylist() == parsed[fmt]
        assert [r["sample_id"] for r in parsed[fmt]] == [r["sample_id"] for r in want]
    assert [json.loads(r["input_ids"]) for r in parsed["csv"]] == [r["input_ids"] for r in want]
    assert [r["input_ids"] for r in parsed["json"]] == [r["input_ids"] for r in parsed["parquet"]]
    assert [r["reward"] for r in parsed["json"]] == [r["reward"] for r in want]
    assert parsed["parquet"][0]["created_at"] == want[0]["created_at"]
    assert parsed["csv"][0]["created_at"].endswith("+00") and parsed["csv"][0]["created_at"].startswith("2026-11-22")
    assert not list(tmp_path.glob(".*.tmp")), "the staged output is renamed onto its target"


def test_table_limit_sql_from_a_file_and_stdin(runs: list[RunPaths], tmp_path: Path) -> None:
    run = str(runs[0].root)
    table = arl_query(run, "SELECT step, sample_id, input_ids FROM samples ORDER BY step, sample_id")
    assert table.exit_code == 0 and "sample_id" in table.stdout and "first 42 rows" not in table.stdout
    assert "42 rows" in table.stdout and "…" in table.stdout  # long token lists are shortened
    cut = arl_query(run, "SELECT * FROM tokens", "--limit", "3")
    assert cut.exit_code == 0 and "first 3 rows shown" in cut.stdout
    assert len(json.loads(arl_query(run, "SELECT * FROM tokens", "--limit", "3", "--format", "json").stdout)) == 3
    many = arl_query(run, "SELECT * FROM tokens WHERE step = 0")
    assert "first 100 rows shown" in many.stdout
    sql_file = tmp_path / "q.sql"
    sql_file.write_text("-- a comment first\nSELECT count(*) AS n FROM samples")
    from_file = arl_query(run, "-f", str(sql_file), "--format", "csv")
    from_stdin = arl_query(run, "-", "--format", "csv", stdin=sql_file.read_text())
    assert from_file.stdout == from_stdin.stdout == "n\n42\n"
    two = "CREATE VIEW late AS SELECT * FROM samples WHERE step = 2; SELECT count(*) AS n FROM late"
    statements = arl_query(run, two, "--format", "csv")
    assert statements.stdout == f"n\n{SAMPLES_PER_STEP}\n"
    assert arl_query(run, "SET threads = 1").exit_code == 0


# -- mistakes -----------------------------------------------------------------------------------
def one_error_line(result: Any) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("sql", ["SELEC 1", "SELECT rewrd FROM samples", "SELECT * FROM nothing_here",
                                 "SELECT 'x'::INTEGER"])  # fmt: skip
def test_bad_sql_is_one_line_with_duckdbs_message(sql: str, runs: list[RunPaths]) -> None:
    line = one_error_line(arl_query(str(runs[1].root), sql))
    con = duckdb.connect()
    con.execute("CREATE TABLE samples (reward FLOAT)")
    with pytest.raises(duckdb.Error) as duck:
        con.sql(sql).fetchall()
    assert str(duck.value).splitlines()[0] in line


def test_run_dir_mistakes(runs: list[RunPaths], tmp_path: Path) -> None:
    a = str(runs[0].root)
    assert "given twice" in one_error_line(arl_query(a, a + "/", "SELECT 1"))
    assert "not a run dir" in one_error_line(arl_query(str(runs[0].root.parent), "SELECT 1"))
    assert "no such run dir" in one_error_line(arl_query(str(tmp_path / "typo"), "SELECT 1"))
    assert "must be the SQL" in one_error_line(arl_query(a, str(runs[1].root)))
    assert "then the SQL" in one_error_line(arl_query(a))
    assert "no SQL" in one_error_line(arl_query(a, "-", stdin="  \n"))


def test_parquet_is_not_written_to_a_terminal(runs: list[RunPaths], monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    catalog = connect([runs[1].root])
    monkeypatch.setattr("sys.stdout", Terminal())
    with pytest.raises(ArlError, match="give --output FILE"):
        emit(catalog.connection, catalog.connection.sql("SELECT 1"), fmt="parquet", output=None, limit=None)


def test_the_python_api_labels_runs_and_lists_what_it_read(runs: list[RunPaths]) -> None:
    catalog = connect([r.root for r in runs])
    assert [run.label for run in catalog.runs] == list(GOOD_STEPS)
    assert catalog.read_steps == GOOD_STEPS
    assert "lr" not in catalog.connection.sql("SELECT * FROM samples").columns  # no hive partition column
    assert connect([runs[1].root]).runs[0].label == "trial0"
    assert (runs[0].step_dir(3) / MANIFEST).exists() is False
