"""The tool task (`arl demo --task tools`): its data files are what the task module generates, the held-out set is
unseen, the warm-start corpus teaches the protocol but no answer, the scorer, the calculator's safety, and the
multi-turn warm start trains exactly the tokens the model samples in each turn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.agents.loading import load_object
from pipeline.demo.tasks import EXAMPLES, TOOLS
from pipeline.demo.warm_start import encode_row, load_corpus

AGENT = EXAMPLES / "tools_agent.py"


def _task(name: str) -> Any:
    return load_object(f"{AGENT}:{name}")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_data_files_are_the_task_generators_output_and_held_out_is_unseen() -> None:
    train, held_out = _task("task_rows")()
    assert _jsonl(EXAMPLES / "data" / "tools.jsonl") == train
    assert _jsonl(EXAMPLES / "data" / "tools_eval.jsonl") == held_out
    assert not {(r["a"], r["b"]) for r in train} & {(r["a"], r["b"]) for r in held_out}
    (a_low, a_high), (b_low, b_high) = _task("FIRST"), _task("SECOND")
    assert all(a_low <= r["a"] <= a_high and b_low <= r["b"] <= b_high for r in train + held_out)
    assert all(len(str(r["a"] + r["b"])) == 3 for r in train + held_out)  # fixed-width sums (see FIRST's doc)


def test_the_warm_start_corpus_teaches_the_protocol_but_no_answer() -> None:
    rows = load_corpus(TOOLS.warm_corpus)
    assert _jsonl(TOOLS.warm_corpus) == _task("format_rows")(len(rows), seed=0)
    right = answer_only = 0
    for messages, reply, tools in rows:
        if reply is None:  # a whole episode, as the agent sends it
            assert tools == [_task("CALCULATOR_TOOL")] and messages[0]["content"] == _task("INSTRUCTIONS")
            messages, answer = messages[1:-1], messages[-1]["content"]
        else:  # the answer turn alone, in a short row
            assert tools is None and messages[0]["role"] == "user"
            answer, answer_only = reply, answer_only + 1
        user, call, result = messages
        a, b = (int(x) for x in user["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert result["content"] == _task("calculate")(expression)
        assert answer == _task("answer_text")(result["content"])
        right += _task("parse_answer")(answer) == a + b
    # the call's numbers are drawn independently of the question's: a right answer only by coincidence of sums
    assert right / len(rows) < 0.01
    assert answer_only == len(rows) // 2


def test_a_policy_that_ignores_the_question_gains_nothing() -> None:
    """The closeness term pays for reading the question, not for one well-placed guess: the best fixed answer
    scores about what a random call does, a call with the right hundreds digit several times more."""
    import random

    score = _task("score")
    (a_low, a_high), (b_low, b_high) = _task("FIRST"), _task("SECOND")
    rng = random.Random(0)
    pairs = [(rng.randint(a_low, a_high), rng.randint(b_low, b_high)) for _ in range(4000)]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    best_fixed = max(mean([score(str(c), a + b) for a, b in pairs]) for c in range(110, 999, 7))
    random_call = mean([score(str(rng.randint(a_low, a_high) + rng.randint(b_low, b_high)), a + b) for a, b in pairs])
    hundreds = mean(
        [score(str(a // 100 * 100 + rng.randint(0, 99) + rng.randint(b_low, b_high)), a + b) for a, b in pairs]
    )
    assert best_fixed < 0.08 and random_call < 0.08
    assert hundreds > 3 * best_fixed


def test_score_and_metrics() -> None:
    score, outcome = _task("score"), _task("outcome")
    assert score("125", 125) == 1.0 and score(" 125\n", 125) == 1.0
    assert score("135", 125) == pytest.approx(0.5 * (1 - 10 / 100))
    assert score("300", 125) == 0.0  # farther than 100: nothing
    assert score("125 apples", 125) == 0.0 and score("", 125) == 0.0
    assert outcome("125", 125, 1) == (1.0, {"exact_correct": 1.0, "used_tool": 1.0})
    assert outcome("99", 125, 0)[1] == {"exact_correct": 0.0, "used_tool": 0.0}


def test_calculator_is_safe() -> None:
    calculate = _task("calculate")
    assert calculate("67 + 58") == "125" and calculate("(2 + 3) * -4") == "-20"
    for hostile in ("__import__('os').system('true')", "2 ** 999999", "1 / 0", "9" * 70, "67 +"):
        assert calculate(hostile).startswith("error"), hostile


def test_multi_turn_warm_start_trains_each_turn_as_sampled(tmp_path: Path) -> None:
    """The trained tokens of a corpus row are exactly what the model writes in each turn, end-of-turn included:
    rendered from the same chat template the proxy renders an agent's requests with."""
    from transformers import AutoTokenizer

    from pipeline.demo.tiny_model import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m", num_layers=1))
    messages, reply, tools = load_corpus(TOOLS.warm_corpus)[0]  # a whole episode (the odd rows: the answer only)
    ids, mask = encode_row(tokenizer, messages, reply, tools)
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    expression = messages[2]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert spans == [
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call><|im_end|>',
        f"{messages[4]['content']}<|im_end|>",
    ]
    # the prompt before each turn is the template's own rendering of the conversation so far
    first_turn = mask.index(1)
    assert ids[:first_turn] == tokenizer.apply_chat_template(
        messages[:2], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_every_file_a_demo_task_reads_ships_in_the_wheel() -> None:
    """`arl demo [--task T]` runs from an installed wheel: each task's config, agent, warm-start corpus, dataset and
    eval sets are package data (pyproject.toml), and the overrides name them by absolute paths that exist."""
    import tomllib

    from pipeline.demo.tasks import TASKS, demo_file_overrides

    root = EXAMPLES.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(setuptools["package-data"]["pipeline"])
    for task in TASKS.values():
        overrides = dict(o.split("=", 1) for o in demo_file_overrides(task))
        named = [task.config, task.agent, task.warm_corpus, Path(overrides["rollout.dataset.path"])]
        named += [Path(spec["path"]) for spec in json.loads(overrides.get("eval.sets", "[]"))]
        for path in named:
            assert path.is_absolute() and path.exists(), path
            assert f"examples/{path.relative_to(EXAMPLES)}" in shipped, f"{path} is not package data"


def test_an_unknown_demo_task_is_one_line_and_exit_2() -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["demo", "--task", "chess"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --task must be one of repeat, tools; got 'chess'"
