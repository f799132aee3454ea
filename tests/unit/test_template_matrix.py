"""Every original chat template TRL ships (`trl/chat_templates/*.jinja`, byte-identical to the model families'
repos; `*_training` are TRL's own patches and left out): the proxy serves each, exactly or honestly, never crashing.

A template joins the matrix the day TRL ships it. Each one is worn by the tiny tokenizer with the family's markup
(every `<...>` marker in the template) added as special tokens and the marker that opens its turn close as the
stop token, so a model "samples" a turn the way the family's model would: the template's own rendering of the
reply, up to and including that marker. A four-call conversation (a tool call and its result where the template
renders tool calls, reasoning where it renders reasoning, a second user message) then runs through the proxy's
`prepare`, and at every call:

* `history: template` (the default): the engine's input is the template's own rendering of the conversation at
  that call, whatever the template does to earlier turns; where it rewrites them the call is a counted prefix
  break (`template_rewrites_history`), never a row whose context differs from that rendering;
* `history: sampled`: the history is the sampled tokens, one row per conversation wherever the template is
  prefix-stable.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from pipeline.engine.client import EngineClient
from pipeline.proxy.core import Generator
from pipeline.proxy.errors import ApiError
from pipeline.proxy.messages import message_key
from pipeline.proxy.prepare import CallSpec
from pipeline.proxy.sessions import SessionStore
from pipeline.proxy.template_style import UnsupportedTemplate
from pipeline.proxy.tokenize import ChatTokenizer
from pipeline.proxy.trajectory import Interaction
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

TEMPLATES = sorted(
    p for p in (resources.files("trl") / "chat_templates").iterdir()  # type: ignore[attr-defined]
    if p.name.endswith(".jinja") and not p.name.endswith("_training.jinja")
)  # fmt: skip
NAMES = [p.name.removesuffix(".jinja") for p in TEMPLATES]
MARKER = re.compile(r"<[|｜/]?[A-Za-z][\w▁.|｜-]*[|｜]?>")
"""The families' markup: <|im_start|>, <｜Assistant｜>, <start_of_turn>, <|turn>, <turn|>, </think>, ..."""
PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": PARAMETERS}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.fixture(scope="module")
def matrix_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return tmp_path_factory.mktemp("template_matrix")


def _family(name: str, source: Path, tiny: Path, root: Path) -> Path:
    """The tiny tokenizer wearing the template `name`: its markers as special tokens, its close's first marker as
    the stop token (generation_config.json, as real checkpoints list theirs)."""
    from transformers import AutoTokenizer

    text = source.read_text(encoding="utf-8")
    out = root / name
    if out.exists():
        return out
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    hf = AutoTokenizer.from_pretrained(tiny)
    markers = sorted(set(MARKER.findall(text)) - set(hf.get_vocab()))
    hf.add_special_tokens({"additional_special_tokens": markers}, replace_extra_special_tokens=False)
    if "bos_token" in text and hf.bos_token is None:  # Llama 3.0 writes it; the tiny tokenizer has none
        hf.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    hf.chat_template = text
    hf.save_pretrained(out)
    tok = ChatTokenizer(out)
    stop = _stop_marker(tok)
    if stop is not None:
        config = json.loads((out / "generation_config.json").read_text())
        config["eos_token_id"] = [hf.convert_tokens_to_ids(stop), hf.eos_token_id]
        (out / "generation_config.json").write_text(json.dumps(config))
    return out


def _stop_marker(tok: ChatTokenizer) -> str | None:
    """The marker a model of the family stops on: the first in its turn close, or, for a template without one
    (GLM: a turn ends where the next role's header begins), the header the template writes next."""
    found = MARKER.search(tok.close_text)
    if found is None:
        after = tok.render_after({"role": "assistant", "content": "a"}, [{"role": "user", "content": "u"}]) or ""
        found = MARKER.search(after)
    return found.group(0) if found is not None else None


def _conversation(tok: ChatTokenizer) -> list[tuple[list[dict], dict]]:
    """(new messages of each call, the assistant's reply): tools and reasoning where the template renders them."""
    think = "reasoning_content" if "reasoning_content" in tok.template_text else None
    calls = tok.style.renders_tool_calls

    def reply(content: str, reasoning: str | None = None, tool: bool = False) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning and think:
            message["reasoning_content"] = reasoning
        if tool and calls:
            message["tool_calls"] = [CALL]
        return message

    result = {"role": "tool", "tool_call_id": "call_0", "content": "1"}
    second = [result] if calls else [{"role": "user", "content": "Go on."}]
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add one."}]
    try:
        tok.render(first, None, add_generation_prompt=True)
    except ApiError:  # Gemma: "System role not supported"
        first = first[1:]
    return [
        (first, reply("" if calls else "Sure.", "Use the tool.", tool=True)),
        (second, reply("It is 1.", "The tool said 1.")),
        ([{"role": "user", "content": "And again?"}], reply("Again 1.", "Same.")),
        ([{"role": "user", "content": "Thanks."}], reply("Welcome.")),
    ]  # fmt: skip


def _sampled(tok: ChatTokenizer, history: list[dict], reply: dict, tools: list | None) -> tuple[list[int], bool]:
    """What a model of the family samples for `reply`, and whether it is the template's own rendering of it: the
    rendering after the generation prompt, up to and including the close's first marker. Where the template renders
    the reply otherwise once it is history (DeepSeek's `<think>` prefill, gpt-oss's channels, Gemma 4's dropped
    thoughts), no sampled text is that rendering: the model writes the reply's content and stops."""
    stop = _stop_marker(tok)
    assert stop is not None, f"no stop marker for the turn close {tok.close_text!r}"
    end = tok.close_text[: tok.close_text.index(stop) + len(stop)] if stop in tok.close_text else stop
    before = tok.render(history, tools, add_generation_prompt=True)
    after = tok.render([*history, reply], tools, add_generation_prompt=False)
    turn = after[len(before) :] if after.startswith(before) else ""
    if turn.endswith(tok.close_text):
        return tok.encode(turn[: len(turn) - len(tok.close_text)] + end), True
    return tok.encode(str(reply.get("content") or "") + end), False


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("history", ["template", "sampled"])
def test_every_trl_template_is_served_exactly_or_honestly(
    name: str, history: str, matrix_dir: Path, tiny_model_dir: Path
) -> None:
    model_dir = _family(name, TEMPLATES[NAMES.index(name)], tiny_model_dir, matrix_dir)
    tok = ChatTokenizer(model_dir)
    proxy = ProxyConfig(history=history)
    gen = Generator(tok, EngineClient([]), ModelConfig(path=str(model_dir)), proxy)
    session = SessionStore(proxy, "admin").start("admin", None, None)
    tools = TOOLS if tok.style.renders_tool_calls else None
    messages: list[dict] = []
    previous: Interaction | None = None
    breaks, unfaithful = [], 0
    for t, (new, reply) in enumerate(_conversation(tok)):
        if previous is not None:
            messages.append(previous.response_message)
        messages.extend(new)
        prep = gen.prepare(session, CallSpec(messages=list(messages), tools=tools))
        rendered = tok.render(messages, tools, add_generation_prompt=True)
        seen = tok.decode(prep.prompt_ids, skip_special_tokens=False)
        if prep.prefix_break:
            breaks.append(prep.break_reason)
        if history == "template" or previous is None or prep.prefix_break:
            assert seen == rendered, f"call {t}: the engine's input is not the template's rendering"
        else:
            assert previous is not None and prep.prompt_ids[: len(previous.full_ids)] == previous.full_ids
        output, faithful = _sampled(tok, messages, reply, tools)
        unfaithful += not faithful
        previous = Interaction(id=f"i{t}", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=output,
                               output_logprobs=[-0.1] * len(output), output_versions=[0] * len(output),
                               messages=list(messages), response_message=reply, prefix_break=prep.prefix_break,
                               parent_id=prep.parent.id if prep.parent else None)  # fmt: skip
        session.record(previous, prep.keys, message_key(reply), prep.tools_key, prep.prompt_text)
    print(f"{name} {history}: breaks {breaks} unfaithful {unfaithful}")
    assert set(breaks) <= {"template_rewrites_history", "template_not_prefix_stable"}
    if history == "sampled":
        assert "template_rewrites_history" not in breaks
    elif unfaithful:  # the reply as sampled is not what the template shows next: the next call must say so
        assert breaks, "a rewritten turn was kept as history under history: template"
    elif tok.turn_local and tok.suffix_local:  # sampled as the template writes it, rendered locally: one row
        assert not breaks


def test_a_template_that_cannot_render_text_is_refused_in_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Refused when the proxy starts, naming what failed for each shape tried, not on an agent's first call."""
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content.missing.text }}{% endfor %}")
    with pytest.raises(UnsupportedTemplate) as refused:
        ChatTokenizer(tiny_model_dir, chat_template=path)
    message = str(refused.value)
    assert "\n" not in message and "does not render an assistant message's text content" in message
    assert "a string: UndefinedError" in message and "a list of text parts" in message
    path.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(UnsupportedTemplate, match="does not compile"):
        ChatTokenizer(tiny_model_dir, chat_template=path)


@pytest.mark.parametrize("name", ["qwen3_5_think", "deepseek_r1_distill", "nemotron_3_nano", "qwen3_5_nothink"])
def test_templates_whose_generation_prompt_opens_reasoning_start_the_parse_inside_it(
    name: str, matrix_dir: Path, tiny_model_dir: Path
) -> None:
    """The real templates decide it: Qwen3.5 (think), DeepSeek-R1 and Nemotron 3 end their generation prompt in an
    open `<think>`, so a tool call the model writes before `</think>` is reasoning; Qwen3.5 no-think closes it."""
    model_dir = _family(name, TEMPLATES[NAMES.index(name)], tiny_model_dir, matrix_dir)
    tok = ChatTokenizer(model_dir)
    gen = Generator(tok, EngineClient([]), ModelConfig(path=str(model_dir), reasoning_parser="think"), ProxyConfig())
    assert gen.prompt_opens_reasoning is (name != "qwen3_5_nothink")
