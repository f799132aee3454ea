"""How the proxy hands a conversation to a chat template (pipeline/proxy/template_style.py), on small templates
written to have each shape; the real ones are in test_template_matrix.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.proxy.template_style import MessageStyle, UnsupportedTemplate, detect, text_after_turn

CALLS = "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}<CALL>{% endfor %}|{% endfor %}"
ITEMS = CALLS.replace("CALL", "{% for k, v in c.function.arguments|items %}{{ k }}={{ v }}{% endfor %}")
TOJSON = CALLS.replace("CALL", "{{ c.function.arguments|tojson }}")
NO_TOOLS = "{% for m in messages %}{{ m.content }}|{% endfor %}"
PARTS = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}|{% endfor %}"


def _render(source: str) -> Any:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(source)
    return lambda messages, tools, prompt: template.render(messages=messages, tools=tools, add_generation_prompt=prompt)


@pytest.mark.parametrize(
    ("source", "style"),
    [
        (ITEMS, MessageStyle(arguments_mapping=True)),  # iterates the arguments: a string would raise
        (TOJSON, MessageStyle(arguments_mapping=True)),  # encodes them: a string would be encoded twice
        (NO_TOOLS, MessageStyle(renders_tool_calls=False)),
        (PARTS, MessageStyle(content_parts=True, renders_tool_calls=False)),
    ],
)
def test_each_template_gets_the_shapes_it_reads(source: str, style: MessageStyle) -> None:
    assert detect(_render(source), "t.jinja") == style


def test_adapt_parses_object_arguments_only_and_leaves_the_callers_messages_alone() -> None:
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
             {"id": "b", "type": "function", "function": {"name": "f", "arguments": "not json"}},
             {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}},
             {"id": "d", "type": "function", "function": {"name": "f", "arguments": ""}}]  # fmt: skip
    messages = [{"role": "assistant", "content": "hi", "tool_calls": calls}]
    before = json.dumps(messages)
    (adapted,) = MessageStyle(content_parts=True).adapt(messages)
    assert [c["function"]["arguments"] for c in adapted["tool_calls"]] == [{"x": [1, 2]}, "not json", "[1]", {}]
    assert adapted["content"] == [{"type": "text", "text": "hi"}]
    assert json.dumps(messages) == before


def test_a_template_without_text_is_refused_naming_both_shapes() -> None:
    with pytest.raises(UnsupportedTemplate, match=r"t\.jinja does not render .*a string: .*a list of text parts"):
        detect(_render("{% for m in messages %}x{% endfor %}"), "t.jinja")


def test_text_after_turn_finds_the_new_messages_where_the_template_rewrites_the_history() -> None:
    """A template that drops earlier replies' reasoning once a user follows: the new text is still told apart."""
    source = (
        "{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' and loop.last %}{{ m.reasoning_content }}"
        "{% endif %}{{ m.content }}<end>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    render = _render(source)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                {"role": "user", "content": "n"}]  # fmt: skip
    full = render(messages, None, True)
    assert full == "[user]q<end>[assistant]a<end>[user]n<end>[assistant]"
    assert text_after_turn(render, "<end>", messages, None, 2, full) == "[user]n<end>[assistant]"
    assert text_after_turn(render, "", messages, None, 2, full) is None  # no turn close: cannot be told
