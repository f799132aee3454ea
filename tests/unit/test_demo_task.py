"""The demo's task: its score, the ceiling of a prompt-ignoring policy computed from the shipped dataset,
the format-only warm-start corpus, and the warm start itself on a real tiny model."""

from __future__ import annotations

import hashlib
import itertools
import json
import string
from collections import Counter
from pathlib import Path

import pytest

from pipeline.agents.loading import load_object
from pipeline.demo.tasks import EXAMPLES, REPEAT
from pipeline.demo.tiny_model import make_tiny_model
from pipeline.demo.warm_start import load_corpus, read_record, warm_start
from pipeline.errors import ArlError

AGENT_FILE = Path(__file__).resolve().parents[2] / "examples" / "demo_agent.py"
DEMO_DATA, DEMO_FORMAT = EXAMPLES / "data" / "demo.jsonl", REPEAT.warm_corpus


def _agent_module_function(name: str) -> object:
    return load_object(f"{AGENT_FILE}:{name}")


def _numbers() -> list[str]:
    return [str(json.loads(line)["number"]) for line in DEMO_DATA.read_text().splitlines() if line.strip()]


def test_score_grades_format_and_each_digit() -> None:
    score = _agent_module_function("score")
    exact = _agent_module_function("exact_correct")
    assert score("59", "59") == pytest.approx(1.0) and exact(" 59\n", "59")
    assert score("95", "59") == pytest.approx(0.2)  # the number's digits, the wrong order: format only
    assert score("5", "59") == pytest.approx(0.4)  # first digit, not two digits
    assert score("590", "59") == pytest.approx(0.8) and not exact("590", "59")
    assert score("", "59") == 0.0 and score("hello", "59") == 0.0


def test_a_policy_that_ignores_the_prompt_scores_at_most_0_3_on_the_shipped_dataset() -> None:
    """A prompt-ignoring policy draws its reply from one distribution for every prompt; its expected score is
    a mixture of fixed replies' mean scores, so the best fixed reply bounds it. Only a reply's first two
    characters and its two-digit format count, so two-character replies cover every case."""
    score = _agent_module_function("score")
    numbers = _numbers()
    alphabet = string.digits + "a -"
    candidates = ["", *alphabet, *("".join(p) for p in itertools.product(alphabet, repeat=2)), "599", "5x9"]
    best = max(sum(score(reply, n) for n in numbers) / len(numbers) for reply in candidates)
    first = Counter(n[0] for n in numbers).most_common(1)[0][1] / len(numbers)
    second = Counter(n[1] for n in numbers).most_common(1)[0][1] / len(numbers)
    assert best == pytest.approx(0.2 + 0.4 * first + 0.4 * second)
    assert best <= 0.3, f"a prompt-ignoring policy could score {best:.3f}"
    assert sorted(Counter(numbers).values()) == [2] * 90  # every number 10..99 twice: the 0.284 of the docs
    assert best == pytest.approx(0.2 + 0.4 / 9 + 0.4 / 10)


def test_the_warm_start_corpus_teaches_the_format_only() -> None:
    """No prompt names a number or asks to repeat, and the replies are two-digit numbers unrelated to their
    prompts: the corpus cannot teach copying."""
    rows = load_corpus(DEMO_FORMAT)
    prompts = {json.dumps(messages) for messages, _, _ in rows}
    for messages, reply, tools in rows:
        assert tools is None and reply is not None
        text = " ".join(m["content"] for m in messages)
        assert not any(ch.isdigit() for ch in text) and "repeat" not in text.lower(), text
        assert len(reply) == 2 and reply.isdigit()
    # each prompt wording is paired with many different replies, so the prompt does not predict the reply
    by_prompt = Counter(json.dumps(m) for m, _, _ in rows)
    replies_per_prompt = {p: {r for m, r, _ in rows if json.dumps(m) == p} for p in prompts}
    assert all(len(replies_per_prompt[p]) >= by_prompt[p] // 2 for p in prompts)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_warm_start_trains_in_place_deterministically_and_records_itself(tmp_path: Path) -> None:
    first, second = make_tiny_model(tmp_path / "a", num_layers=1), make_tiny_model(tmp_path / "b", num_layers=1)
    before = _sha(first / "model.safetensors")
    result = warm_start(first, DEMO_FORMAT, steps=3, batch_size=8)
    warm_start(second, DEMO_FORMAT, steps=3, batch_size=8)
    assert _sha(first / "model.safetensors") != before
    assert _sha(first / "model.safetensors") == _sha(second / "model.safetensors")  # same arguments, same weights
    assert result.last_loss < result.first_loss
    assert read_record(first) == result and read_record(tmp_path / "nowhere") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dir left behind


def test_warm_start_names_a_bad_corpus_row(tmp_path: Path) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(json.dumps({"prompt": "Pick a number.", "reply": "12"}) + "\n")
    with pytest.raises(ArlError, match=r"bad.jsonl:1: .*'messages'"):
        load_corpus(corpus)
