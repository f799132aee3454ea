"""Token-exact prefix logic (pipeline.proxy.tokenize / core.prepare) against the real tokenizers and templates.

The model's turns are simulated by the tokens of the template's own rendering of each assistant
message (what a model trained on the template would emit, ending at its end-of-turn token). Then
every extended prompt must equal a fresh full render of the conversation: nothing dropped (the
`\\n` after `<|im_end|>`), nothing doubled. The same property with real engine output is tested
in tests/integration/test_token_exact_engine.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.engine.client import EngineClient
from pipeline.proxy.core import Generator
from pipeline.proxy.messages import message_key
from pipeline.proxy.prepare import CallSpec
from pipeline.proxy.sessions import SessionStore
from pipeline.proxy.tokenize import ChatTokenizer
from pipeline.proxy.trajectory import Interaction
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object"}}}]


def _call(i: int, args: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": args}}


# (new messages sent with this request, the assistant message the "model" answers with)
TURNS: list[tuple[list[dict], dict]] = [
    ([{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 1 + 2?"}],
     {"role": "assistant", "content": "", "reasoning_content": "I should add.",
      "tool_calls": [_call(0, '{"a": 1, "b": 2}'), _call(1, '{"a": 2, "b": 1}')]}),
    ([{"role": "tool", "tool_call_id": "call_0", "content": "3"},
      {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
     {"role": "assistant", "content": "Both give 3."}),
    ([{"role": "user", "content": "And 20 + 22?"}],
     {"role": "assistant", "content": "Checking.", "tool_calls": [_call(2, '{"a": 20, "b": 22}')]}),
    ([{"role": "tool", "tool_call_id": "call_2", "content": "42"}],
     {"role": "assistant", "content": "It is 42.", "reasoning_content": "Easy."}),
]  # fmt: skip


def _setup(model_dir: Path, history: str = "template") -> tuple[Generator, SessionStore]:
    model = ModelConfig(path=str(model_dir))
    tok = ChatTokenizer(model_dir)
    proxy = ProxyConfig(history=history)
    return Generator(tok, EngineClient([]), model, proxy), SessionStore(proxy, "admin")


def _model_output(tok: ChatTokenizer, history: list[dict], reply: dict, ended: bool) -> list[int]:
    """The tokens a template-faithful model samples for `reply`: its rendered turn up to the end-of-turn token."""
    before = tok.render(history, TOOLS, add_generation_prompt=True)
    after = tok.render([*history, reply], TOOLS, add_generation_prompt=False)
    assert after.startswith(before)
    turn = after[len(before) :]
    assert turn.endswith(tok.close_text)
    body = turn[: len(turn) - len(tok.close_text)]
    eot = next(t for t in tok.stop_token_ids if tok.close_text.startswith(tok.token_text(t)))
    return tok.encode(body) + ([eot] if ended else [])


@pytest.mark.parametrize("template", ["qwen", "llama3"])
@pytest.mark.parametrize("ended", [True, False], ids=["eos", "length"])
@pytest.mark.parametrize("path", ["window", "one-render", "two-renders"])
def test_extended_prompts_equal_full_renders(template: str, ended: bool, path: str,
                                             request: pytest.FixtureRequest) -> None:  # fmt: skip
    model_dir = request.getfixturevalue("tiny_model_dir" if template == "qwen" else "tiny_llama_dir")
    gen, store = _setup(model_dir)
    tok = gen.tokenizer
    assert tok.turn_local, "both test templates render an assistant turn independently of what precedes it"
    assert tok.suffix_local, "... and the messages after it independently of what precedes it"
    tok.verify_every = 0  # the window path alone, without the sampled full-render check that would mask a bug
    tok.suffix_local = path == "window"
    fast = path != "two-renders"
    session = store.start("admin", None, None)
    messages: list[dict] = []
    previous: Interaction | None = None
    for t, (new, reply) in enumerate(TURNS):
        if previous is not None:
            messages.append(previous.response_message)
        messages.extend(new)
        prep = gen.prepare(session, CallSpec(messages=list(messages), tools=TOOLS))
        assert prep.prefix_break is False
        assert (prep.parent.id if prep.parent else None) == (previous.id if previous else None)
        expected = tok.encode(tok.render(messages, TOOLS, add_generation_prompt=True))
        if ended or t == 0:
            # With the end-of-turn token sampled, the extension is exactly the fresh render.
            assert prep.prompt_ids == expected, f"turn {t}: extended prompt differs from the full render"
        else:
            # After a length stop the whole close (e.g. "<|im_end|>\n") is added as prompt tokens:
            # the fresh render tokenises the same text the same way.
            assert tok.decode(prep.prompt_ids, skip_special_tokens=False) == tok.decode(expected, False)
        if previous is not None:
            head = [*previous.prompt_ids, *previous.output_ids]
            assert prep.prompt_ids[: len(head)] == head, "history must be reused, never re-tokenized"
        output = _model_output(tok, messages, reply, ended)
        previous = Interaction(id=f"i{t}", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=output,
                               output_logprobs=[-0.1] * len(output), output_versions=[0] * len(output),
                               messages=list(messages), response_message=reply,
                               parent_id=prep.parent.id if prep.parent else None)  # fmt: skip
        # the rendered text is kept for the next turn's fast paths (used when the template is turn-local)
        session.record(previous, prep.keys, message_key(reply), prep.tools_key, prep.prompt_text if fast else None)
    rows = session.tree.export("concat", 1.0, step=0)
    assert len(rows) == 1 and rows[0].num_turns == len(TURNS)


def test_qwen_newline_after_im_end_goes_to_the_suffix(tiny_model_dir: Path) -> None:
    tok = ChatTokenizer(tiny_model_dir)
    assert tok.close_text == "<|im_end|>\n"
    im_end = tok.encode("<|im_end|>")
    assert tok.close_tail(tok.encode("hi") + im_end) == "\n"
    assert tok.close_tail(tok.encode("hi")) == "<|im_end|>\n"  # length stop: the model never closed the turn


@pytest.mark.parametrize("history", ["sampled", "template"])
def test_context_dependent_template_takes_the_two_render_path(
    tiny_model_dir: Path, tmp_path: Path, history: str
) -> None:
    """An assistant header that numbers the message is not turn-local: the fast path is off. The history's header
    ("assistant1") is not the generation prompt the reply was sampled after ("assistant"): with `history: sampled`
    the exact two-render path still extends token-exactly; with `template` the call is the template's own
    rendering, a counted prefix break."""
    original = ChatTokenizer(tiny_model_dir).template_text
    header = "'<|im_start|>' + message.role + '\\n' }}"
    assert original.count(header) == 1
    path = tmp_path / "numbered.jinja"
    path.write_text(original.replace(header, "'<|im_start|>' + message.role + (loop.index0 | string) + '\\n' }}"))
    model = ModelConfig(path=str(tiny_model_dir), chat_template=str(path))
    tok = ChatTokenizer(tiny_model_dir, chat_template=path)
    assert tok.turn_local is False
    proxy = ProxyConfig(history=history)
    gen, store = Generator(tok, EngineClient([]), model, proxy), SessionStore(proxy, "admin")
    session = store.start("admin", None, None)
    first = [{"role": "user", "content": "hi"}]
    prep = gen.prepare(session, CallSpec(messages=first))
    reply = {"role": "assistant", "content": "yo"}
    out = tok.encode("yo<|im_end|>")
    parent = Interaction(id="p", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=out,
                         output_logprobs=[0.0] * len(out), output_versions=[0] * len(out), messages=first,
                         response_message=reply)  # fmt: skip
    session.record(parent, prep.keys, message_key(reply), prep.tools_key, prep.prompt_text)
    messages = [*first, reply, {"role": "user", "content": "more"}]
    nxt = gen.prepare(session, CallSpec(messages=messages))
    if history == "sampled":
        assert not nxt.prefix_break and nxt.prompt_ids[: len(parent.full_ids)] == parent.full_ids
    else:
        assert nxt.break_reason == "template_rewrites_history"
        assert nxt.prompt_ids == tok.encode(tok.render(messages, None, add_generation_prompt=True))
        assert "<|im_start|>assistant1\nyo" in tok.decode(nxt.prompt_ids, skip_special_tokens=False)


def test_llama3_has_no_tail_after_eot(tiny_llama_dir: Path) -> None:
    tok = ChatTokenizer(tiny_llama_dir)
    assert tok.close_text == "<|eot_id|>"
    assert tok.close_tail(tok.encode("hi<|eot_id|>")) == ""


@pytest.mark.parametrize("history", ["sampled", "template"])
def test_sdk_reserialisation_still_extends(tiny_model_dir: Path, history: str) -> None:
    """content None vs "", arguments re-spaced, extra fields: still the same conversation, extended token-exactly.
    The template renders arguments as a mapping (as vLLM and SGLang do), so re-spacing does not change its
    rendering. Re-ordered keys and dropped reasoning do: under `history: sampled` the sampled tokens stay the
    history; under `template` that call is the template's rendering, a counted break."""
    gen, store = _setup(tiny_model_dir, history)
    session = store.start("admin", None, None)
    first = [{"role": "user", "content": "What is 1 + 2?"}]
    prep = gen.prepare(session, CallSpec(messages=first, tools=TOOLS))
    reply = TURNS[0][1]
    out = _model_output(gen.tokenizer, first, reply, True)
    parent = Interaction(id="p", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=out,
                         output_logprobs=[0.0] * len(out), output_versions=[0] * len(out), messages=first,
                         response_message=reply)  # fmt: skip
    session.record(parent, prep.keys, message_key(reply), prep.tools_key)

    def resend(first_arguments: str, reasoning: bool = True) -> Any:
        calls = [
            {"id": "x", "type": "function", "function": {"name": "add", "arguments": first_arguments}},
            {"id": "y", "type": "function", "function": {"name": "add", "arguments": '{"a":2, "b":1}'}},
        ]
        resent = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "tool_calls": calls}
        if reasoning:
            resent["reasoning_content"] = reply["reasoning_content"]
        spec = CallSpec(messages=[*first, resent, {"role": "user", "content": "ok"}], tools=TOOLS)
        return gen.prepare(session, spec)

    nxt = resend('{"a":1,"b":2}')
    assert nxt.parent is not None and nxt.parent.id == "p" and not nxt.prefix_break
    assert nxt.prompt_ids[: len(parent.full_ids)] == parent.full_ids
    for rewritten in (resend('{"b":2,"a":1}'), resend('{"a":1,"b":2}', reasoning=False)):
        assert rewritten.parent is not None and rewritten.parent.id == "p"
        if history == "sampled":
            assert not rewritten.prefix_break and rewritten.prompt_ids[: len(parent.full_ids)] == parent.full_ids
        else:
            assert rewritten.break_reason == "template_rewrites_history"


def test_edited_history_is_a_recorded_break(tiny_model_dir: Path) -> None:
    gen, store = _setup(tiny_model_dir)
    session = store.start("admin", None, None)
    first = [{"role": "user", "content": "What is 1 + 2?"}]
    prep = gen.prepare(session, CallSpec(messages=first))
    reply = {"role": "assistant", "content": "3"}
    out = gen.tokenizer.encode("3<|im_end|>")
    parent = Interaction(id="p", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=out,
                         output_logprobs=[0.0] * len(out), output_versions=[0] * len(out), messages=first,
                         response_message=reply)  # fmt: skip
    session.record(parent, prep.keys, message_key(reply), prep.tools_key)
    edited = [*first, {"role": "assistant", "content": "three"}, {"role": "user", "content": "sure?"}]
    nxt = gen.prepare(session, CallSpec(messages=edited))
    assert nxt.prefix_break and nxt.break_reason == "history_edited" and nxt.parent is not None
    assert nxt.prompt_ids == gen.tokenizer.prompt_ids(edited, None)
    extended = [*first, reply, {"role": "user", "content": "x"}]
    other_tools = gen.prepare(session, CallSpec(messages=extended, tools=TOOLS))
    assert other_tools.prefix_break, "different tools change the rendered prompt: not an extension"
    unrelated = gen.prepare(session, CallSpec(messages=[{"role": "user", "content": "new task"}]))
    assert unrelated.parent is None and not unrelated.prefix_break


def test_segment_cached_encode_equals_plain_encode(tiny_model_dir: Path, tiny_llama_dir: Path) -> None:
    texts = [
        "<|im_start|>user\nhé日本 <tool_call>{}</tool_call><|im_end|>\n",
        "  \n\n<think>x</think>",
        "",
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>",
        "<|im_end|><|im_end|>a",
    ]
    for model_dir in (tiny_model_dir, tiny_llama_dir):
        tok = ChatTokenizer(model_dir)
        for text in texts * 2:  # the second pass hits the cache
            assert tok.encode(text) == tok.hf.encode(text, add_special_tokens=False), text


def test_a_window_render_unlike_the_full_render_is_caught(tiny_model_dir: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A template whose last message depends on the conversation's length passes the start-up probes
    (short conversations) but renders the new text of a long one differently in a window: the
    sampled check against a full render catches it, turns the window off and the prompt stays exact."""
    original = ChatTokenizer(tiny_model_dir).template_text
    user = "render_content(message.content) + '<|im_end|>'"
    assert original.count(user) == 1
    path = tmp_path / "long.jinja"
    marker = "(' (long)' if loop.last and messages | length > 9 else '')"
    marked = f"render_content(message.content) + {marker} + '<|im_end|>'"
    path.write_text(original.replace(user, marked))
    history = [{"role": "user", "content": "q0"}]
    for i in range(4):
        history += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i + 1}"}]
    reply = {"role": "assistant", "content": "yo"}
    longer = [*history, reply, {"role": "user", "content": "more"}]

    def extended(verify_every: int) -> tuple[ChatTokenizer, list[int], bool]:
        tok = ChatTokenizer(tiny_model_dir, chat_template=path)
        assert tok.turn_local and tok.suffix_local, "the probes' short conversations never show the marker"
        tok.verify_every = verify_every
        model = ModelConfig(path=str(tiny_model_dir), chat_template=str(path))
        gen, store = Generator(tok, EngineClient([]), model, ProxyConfig()), SessionStore(ProxyConfig(), "admin")
        session = store.start("admin", None, None)
        prep = gen.prepare(session, CallSpec(messages=history))
        out = tok.encode("yo<|im_end|>")
        parent = Interaction(id="p", session_id=session.id, prompt_ids=prep.prompt_ids, output_ids=out,
                             output_logprobs=[0.0] * len(out), output_versions=[0] * len(out), messages=history,
                             response_message=reply)  # fmt: skip
        session.record(parent, prep.keys, message_key(reply), prep.tools_key, prep.prompt_text)
        nxt = gen.prepare(session, CallSpec(messages=longer))
        assert nxt.parent is not None and nxt.parent.id == "p"
        return tok, nxt.prompt_ids, nxt.prefix_break

    full = ChatTokenizer(tiny_model_dir, chat_template=path).prompt_ids(longer, None)
    _, ids, _ = extended(verify_every=0)
    assert ids != full, "without the check the window's text (no marker) would have been used"
    with caplog.at_level("WARNING", logger="arl.proxy.tokenize"):
        checked, ids, broke = extended(verify_every=64)  # the first window render is always checked
    assert ids == full and not broke
    assert checked.suffix_local is False and "rendering whole conversations" in caplog.text
