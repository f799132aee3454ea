"""Session trees: reward propagation and export, on worked examples with hand-checked numbers."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from pipeline.proxy.trajectory import Interaction, SessionTree, TrajectoryError, UnknownInteraction
from schemas.trajectory import validate_row


def make(
    iid: str,
    prompt: list[int],
    output: list[int],
    parent: str | None = None,
    *,
    version: int = 0,
    **kw: object,
) -> Interaction:
    return Interaction(
        id=iid,
        session_id="s1",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.5 - 0.1 * i for i in range(len(output))],
        output_versions=[version] * len(output),
        messages=[{"role": "user", "content": iid}],
        response_message={"role": "assistant", "content": "x"},
        parent_id=parent,
        created_at=1_700_000_000.0 + len(prompt),
        **kw,  # type: ignore[arg-type]
    )


def chain() -> SessionTree:
    """A → B → C, each prompt extending the previous prompt + output + a tool/user suffix."""
    tree = SessionTree("s1", "g1", metadata={"index": 7})
    a = make("A", [1, 2, 3], [10, 11], version=3)
    b = make("B", [*a.full_ids, 4, 5], [12], "A", version=3)
    c = make("C", [*b.full_ids, 6], [13, 14, 15], "B", version=4)
    for node in (a, b, c):
        tree.add(node)
    return tree


def test_chain_discounted_rewards_match_the_worked_example() -> None:
    tree = chain()
    tree.set_reward(1.0)  # the last completion: C
    rewards = tree.propagate_rewards(0.9)
    assert rewards == pytest.approx({"A": 0.81, "B": 0.9, "C": 1.0})


def test_own_rewards_add_to_discounted_children() -> None:
    tree = chain()
    tree.set_reward(1.0, "C")
    tree.set_reward(0.5, "A")
    assert tree.propagate_rewards(0.5) == pytest.approx({"A": 0.5 + 0.5 * 0.5, "B": 0.5, "C": 1.0})


def test_branching_tree_takes_the_mean_of_children() -> None:
    # R has children X (reward 1) and Y → Z (reward 0.2 on Z, 0 on Y).
    tree = SessionTree("s1", "g1")
    tree.add(make("R", [1], [2]))
    tree.add(make("X", [1, 2, 3], [4], "R"))
    tree.add(make("Y", [1, 2, 5], [6], "R"))
    tree.add(make("Z", [1, 2, 5, 6, 7], [8], "Y"))
    tree.set_reward(1.0, "X")
    tree.set_reward(0.2, "Z")
    rewards = tree.propagate_rewards(0.5)
    assert rewards["Z"] == pytest.approx(0.2)
    assert rewards["Y"] == pytest.approx(0.1)
    assert rewards["X"] == pytest.approx(1.0)
    assert rewards["R"] == pytest.approx(0.5 * (1.0 + 0.1) / 2)
    concat = tree.export("concat", 0.5, step=0)
    assert [r.sample_id for r in concat] == ["X", "Z"]
    assert [r.reward for r in concat] == pytest.approx([1.0, 0.2])
    assert [r.num_turns for r in concat] == [2, 3]


def test_long_chain_needs_no_recursion() -> None:
    tree = SessionTree("s1", "g1")
    prompt: list[int] = [1]
    parent = None
    for i in range(5000):
        node = make(f"n{i}", prompt, [2], parent)
        tree.add(node)
        prompt, parent = [*node.full_ids, 3], node.id
    tree.set_reward(1.0)
    rewards = tree.propagate_rewards(1.0)
    assert rewards["n0"] == pytest.approx(1.0)
    rows = tree.export("concat", 1.0, step=1)
    assert len(rows) == 1 and rows[0].num_turns == 5000


def test_individual_rows() -> None:
    tree = chain()
    tree.set_reward(1.0)
    rows = tree.export("individual", 0.9, step=5)
    assert [r.sample_id for r in rows] == ["A", "B", "C"]
    assert [r.parent_id for r in rows] == [None, "A", "B"]
    assert [r.reward for r in rows] == pytest.approx([0.81, 0.9, 1.0])
    b = rows[1]
    tree_b = tree.get("B")
    assert b.input_ids == tree_b.prompt_ids + tree_b.output_ids
    assert b.loss_mask == [0] * len(tree_b.prompt_ids) + [1]
    assert b.logprobs == [0.0] * len(tree_b.prompt_ids) + tree_b.output_logprobs
    assert b.versions == [-1] * len(tree_b.prompt_ids) + [3]
    assert b.prompt_len == len(tree_b.prompt_ids)
    for row in rows:
        validate_row(row)
        assert row.step == 5 and row.num_turns == 1 and row.group_id == "g1"
        assert row.created_at == int(tree.get(row.sample_id).created_at * 1000), "epoch ms of the call's finish"
        assert datetime.fromtimestamp(row.created_at / 1000, UTC) >= datetime(2023, 1, 1, tzinfo=UTC)
        meta = json.loads(row.metadata)
        assert meta["index"] == 7 and meta["interaction_ids"] == [row.sample_id]


def test_concat_row_is_the_last_prompt_plus_output_with_every_segment_masked() -> None:
    tree = chain()
    tree.set_reward(1.0)
    (row,) = tree.export("concat", 0.9, step=2)
    c = tree.get("C")
    assert row.input_ids == c.prompt_ids + c.output_ids
    # A: prompt 3, out 2; suffix 2; B out 1; suffix 1; C out 3.
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert row.versions == [-1, -1, -1, 3, 3, -1, -1, 3, -1, 4, 4, 4]
    sampled = [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m]
    assert sampled == pytest.approx(tree.get("A").output_logprobs + tree.get("B").output_logprobs + c.output_logprobs)
    assert row.prompt_len == 3 and row.num_turns == 3 and row.reward == pytest.approx(1.0)
    assert row.sample_id == "C" and row.parent_id is None
    meta = json.loads(row.metadata)
    assert meta["interaction_ids"] == ["A", "B", "C"] and meta["prefix_break"] is False
    validate_row(row)


def test_token_prefix_break_splits_the_concat_row() -> None:
    tree = SessionTree("s1", "g1")
    a = make("A", [1, 2], [3, 4])
    tree.add(a)
    # The agent edited its history: B's prompt does not start with A's prompt + output.
    tree.add(make("B", [1, 2, 9, 9, 5], [6], "A"))
    tree.add(make("C", [1, 2, 9, 9, 5, 6, 7], [8], "B"))
    tree.set_reward(1.0)
    assert tree.prefix_breaks() == ["B"]
    rows = tree.export("concat", 1.0, step=0)
    assert [r.sample_id for r in rows] == ["A", "C"]
    first, second = rows
    assert first.input_ids == [1, 2, 3, 4] and first.num_turns == 1
    assert second.input_ids == [1, 2, 9, 9, 5, 6, 7, 8]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 0, 1]
    assert second.parent_id == "A" and second.num_turns == 2
    assert json.loads(second.metadata)["prefix_break"] is True
    assert json.loads(first.metadata)["prefix_break"] is False
    for row in rows:
        validate_row(row)


def test_flagged_prefix_break_splits_even_when_tokens_extend() -> None:
    tree = SessionTree("s1", "g1")
    a = make("A", [1, 2], [3])
    tree.add(a)
    tree.add(make("B", [*a.full_ids, 4], [5], "A", prefix_break=True))
    assert [r.num_turns for r in tree.export("concat", 1.0, step=0)] == [1, 1]


def test_segment_before_a_break_shared_by_two_paths_is_emitted_once() -> None:
    tree = SessionTree("s1", "g1")
    tree.add(make("A", [1], [2]))
    tree.add(make("B", [7, 7], [3], "A"))  # break
    tree.add(make("C", [7, 7, 3, 4], [5], "B"))
    tree.add(make("D", [7, 7, 3, 6], [8], "B"))
    rows = tree.export("concat", 1.0, step=0)
    assert [r.sample_id for r in rows] == ["A", "C", "D"]
    assert [json.loads(r.metadata)["interaction_ids"] for r in rows] == [["A"], ["B", "C"], ["B", "D"]]


def test_interaction_without_sampled_tokens_gives_no_row() -> None:
    tree = SessionTree("s1", "g1")
    a = make("A", [1, 2], [3])
    tree.add(a)
    tree.add(make("B", [*a.full_ids, 4], [], "A", finish_reason="abort"))
    assert [r.sample_id for r in tree.export("individual", 1.0, step=0)] == ["A"]
    (row,) = tree.export("concat", 1.0, step=0)
    assert row.sample_id == "B" and row.finish_reason == "abort" and row.loss_mask == [0, 0, 1, 0]


def test_set_reward_on_last_named_and_unknown() -> None:
    tree = SessionTree("s1", "g1")
    with pytest.raises(UnknownInteraction, match="no interaction yet"):
        tree.set_reward(1.0)
    tree.add(make("A", [1], [2]))
    tree.add(make("B", [1, 2, 3], [4], "A"))
    tree.set_reward(0.25)
    assert tree.get("B").reward == 0.25
    tree.set_reward(0.75, "A")
    assert tree.get("A").reward == 0.75
    with pytest.raises(UnknownInteraction, match=r"'nope'.*'A', 'B'"):
        tree.set_reward(1.0, "nope")
    with pytest.raises(TrajectoryError, match="finite"):
        tree.set_reward(float("nan"))


def test_add_refuses_inconsistent_interactions() -> None:
    tree = SessionTree("s1", "g1")
    with pytest.raises(TrajectoryError, match=r"parent 'X'.*add the parent first"):
        tree.add(make("A", [1], [2], "X"))
    bad = make("A", [1], [2, 3])
    bad.output_versions = [0]
    with pytest.raises(TrajectoryError, match="differ in length"):
        tree.add(bad)
    with pytest.raises(TrajectoryError, match="finish_reason"):
        tree.add(make("A", [1], [2], finish_reason="eos"))
    tree.add(make("A", [1], [2]))
    with pytest.raises(TrajectoryError, match="already"):
        tree.add(make("A", [1], [2]))


def test_export_refuses_unknown_style_and_bad_discount() -> None:
    tree = chain()
    with pytest.raises(TrajectoryError, match="individual"):
        tree.export("flat", 1.0, step=0)  # type: ignore[arg-type]
    with pytest.raises(TrajectoryError, match="discount"):
        tree.propagate_rewards(1.5)


def test_a_rows_tool_calls_are_the_sum_of_its_turns_parsed_calls() -> None:
    """The proxy notes each turn's parsed calls; a concat row holds its turns' sum, an individual row its own; a
    row without any counts 0 (the viewer counts these, not markup)."""
    tree = SessionTree("s1", "g1", metadata={"index": 7})
    a = make("A", [1, 2, 3], [10, 11], metadata={"parsed_tool_calls": 2})
    b = make("B", [*a.full_ids, 4, 5], [12], "A")
    c = make("C", [*b.full_ids, 6], [13, 14, 15], "B", metadata={"parsed_tool_calls": 1})
    for node in (a, b, c):
        tree.add(node)
    (row,) = tree.export("concat", 1.0)
    assert json.loads(row.metadata)["parsed_tool_calls"] == 3
    counts = [json.loads(r.metadata).get("parsed_tool_calls") for r in tree.export("individual", 1.0)]
    assert counts == [2, 0, 1]


def test_the_viewer_counts_parsed_calls_or_sampled_call_markup() -> None:
    from pipeline.analysis.viewer import find_marks, tool_calls

    texts = [
        "<|im_start|>system\nCall tools as <tool_call>...</tool_call>",
        "<|im_end|>",
        "<tool_call>",
        "{}",
        "</tool_call>",
    ]
    marks, _ = find_marks(texts)
    mask = "00111"  # the instructions are prompt tokens: not a call
    assert tool_calls({}, marks, mask) == 1
    assert tool_calls({"parsed_tool_calls": 0}, marks, mask) == 0, "the parser rejected the sampled markup"
