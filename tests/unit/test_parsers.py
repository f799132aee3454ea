"""Tool-call and reasoning parsers: whole-text results, and the same results under any chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.proxy.parsers import (
    TOOL_PARSERS,
    OutputParser,
    Parsed,
    ToolStream,
    check_parser_names,
    collect,
    parse_text,
    register_tool_parser,
)


def _summary(p: Parsed) -> tuple[str, str, list[tuple[str, dict]]]:
    return p.reasoning, p.content, [(c.name, json.loads(c.arguments)) for c in p.tool_calls]


def test_hermes_reasoning_content_and_two_calls() -> None:
    text = (
        "<think>\nLet me think.\n</think>\n\nI will add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"a": 3}}\n</tool_call>'
    )
    assert _summary(parse_text(text, "hermes", "think")) == (
        "Let me think.", "I will add.", [("add", {"a": 1, "b": 2}), ("mul", {"a": 3})],
    )  # fmt: skip


def test_tool_call_inside_think_is_reasoning_not_a_call() -> None:
    text = '<think>maybe <tool_call>{"name": "add", "arguments": {}}</tool_call></think>Done.'
    reasoning, content, calls = _summary(parse_text(text, "hermes", "think"))
    assert calls == []
    assert "<tool_call>" in reasoning
    assert content == "Done."


def test_invalid_json_tool_call_stays_content() -> None:
    text = "<tool_call>{not json}</tool_call> after"
    assert _summary(parse_text(text, "hermes", "none")) == ("", "<tool_call>{not json}</tool_call> after", [])


def test_unterminated_call_with_complete_json_is_a_call() -> None:
    assert _summary(parse_text('<tool_call>\n{"name": "f", "arguments": {"x": "y"}}', "hermes", "none"))[2] == [
        ("f", {"x": "y"})
    ]


def test_plain_text_keeps_its_whitespace() -> None:
    assert parse_text("  Hello \n", "hermes", "think").content == "  Hello \n"


def test_unterminated_think_is_all_reasoning() -> None:
    p = parse_text("<think>\nstill thinking", "hermes", "think")
    assert (p.reasoning, p.content) == ("still thinking", "")


def test_reasoning_parser_none_keeps_think_markup_as_content() -> None:
    assert parse_text("<think>x</think>y", "none", "none").content == "<think>x</think>y"


def test_llama3_json_calls_separated_by_semicolons() -> None:
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "get", "parameters": {"q": "a; b"}}'
    assert _summary(parse_text(text, "llama3_json", "think"))[2] == [("add", {"a": 1}), ("get", {"q": "a; b"})]


def test_llama3_json_non_call_json_is_content() -> None:
    assert parse_text('{"result": 3}', "llama3_json", "none").content == '{"result": 3}'
    assert parse_text("The answer is {3}", "llama3_json", "none").content == "The answer is {3}"


def test_prefill_completes_a_named_call() -> None:
    cls = TOOL_PARSERS["hermes"]
    text = cls.prefill("add") + '{"a": 1}}\n</tool_call>'
    assert _summary(parse_text(text, "hermes", "think"))[2] == [("add", {"a": 1})]
    llama = TOOL_PARSERS["llama3_json"].prefill("add") + '{"a": 1}}'
    assert _summary(parse_text(llama, "llama3_json", "think"))[2] == [("add", {"a": 1})]


def test_registry_and_name_check() -> None:
    class Upper(ToolStream):
        name = "upper"

        def feed(self, text: str) -> list:
            return super().feed(text.upper())

    register_tool_parser("upper", Upper)
    try:
        assert parse_text("abc", "upper", "none").content == "ABC"
        check_parser_names("upper", "think")
        with pytest.raises(ValueError, match="not a known parser"):
            check_parser_names("nope", "think")
        with pytest.raises(ValueError, match="reasoning_parser"):
            check_parser_names("hermes", "nope")
    finally:
        TOOL_PARSERS.pop("upper")


_PIECES = st.sampled_from([
    "<think>", "</think>", "\n", "\n\n", "hello", " ", "<tool_call>", "</tool_call>", "<tool", "_call>",
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}', "; ", "{", "}", "<", "</",
    "think>", "é", "日本",
])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_PIECES, max_size=14),
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=40),
    tool=st.sampled_from(["hermes", "llama3_json", "none"]),
    reasoning=st.sampled_from(["think", "none"]),
)
def test_any_chunking_gives_the_whole_text_result(pieces: list[str], cuts: list[int], tool: str,
                                                  reasoning: str) -> None:  # fmt: skip
    """Streaming equals non-streaming: the property the proxy's streamed answers rely on."""
    text = "".join(pieces)
    whole = parse_text(text, tool, reasoning)
    parser = OutputParser(tool, reasoning)
    events, pos, i = [], 0, 0
    while pos < len(text):
        step = cuts[i % len(cuts)]
        events += parser.feed(text[pos : pos + step])
        pos, i = pos + step, i + 1
    chunked = collect(events + parser.finish())
    assert _summary(chunked) == _summary(whole)


OPENED = (  # after a generation prompt ending in "<think>\n" (Qwen3.5, DeepSeek-R1, Nemotron 3): no opening tag
    'I could call <tool_call>\n{"name": "add", "arguments": {"a": 9}}\n</tool_call> but let me think.\n</think>\n\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
)


@pytest.mark.parametrize("chunk", [1, 3, 7, len(OPENED)])
def test_a_prompt_that_opened_the_reasoning_keeps_its_tool_markup_out_of_the_calls(chunk: int) -> None:
    """The call written inside the reasoning is reasoning; the one after `</think>` is the call, in any chunking."""
    parser = OutputParser("hermes", "think", thinking=True)
    events = [e for i in range(0, len(OPENED), chunk) for e in parser.feed(OPENED[i : i + chunk])]
    reasoning, content, calls = _summary(collect(events + parser.finish()))
    assert calls == [("add", {"a": 1})] and content == ""
    assert reasoning.startswith("I could call <tool_call>") and reasoning.endswith("let me think.")
    # without the prompt's opening, the same text is content and its first call would be executed
    assert _summary(parse_text(OPENED, "hermes", "think"))[2][0] == ("add", {"a": 9})


def test_an_empty_opened_reasoning_is_no_reasoning() -> None:
    assert parse_text("\n</think>\n\nHello.", "hermes", "think", thinking=True) == Parsed("", "Hello.", [])
    assert parse_text("Unfinished thought", "none", "think", thinking=True).reasoning == "Unfinished thought"
