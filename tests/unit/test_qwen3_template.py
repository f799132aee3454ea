"""arl's Qwen3 chat template (pipeline/templates/qwen3.jinja, worn by `make-tiny-model --arch qwen3|qwen3_moe`)
renders exactly what Qwen3's own template renders: the original in the installed TRL package
(`trl/chat_templates/qwen3.jinja`, byte-identical to the model repo's) is the judge, over generated conversations."""

from __future__ import annotations

import random
from importlib import resources
from typing import Any

import pytest

from pipeline.demo.tiny_model import chat_template

CONTENTS = ["", "Hi.", "\nLead.", "Two\nlines\n", "<think>\nhmm\n</think>\n\nSo 4.", "x</think>y",
            "<tool_response>\n3\n</tool_response>", "Plain <think> open"]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]


def _render(source: str, messages: list[dict], tools: list | None, prompt: bool, extra: dict[str, Any]) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source).render(messages=messages, tools=tools, add_generation_prompt=prompt, **extra)


def _conversation(rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(CONTENTS)})
    for _ in range(rng.randint(1, 7)):
        role = rng.choice(["user", "assistant", "assistant", "tool", "system"])
        message: dict[str, Any] = {"role": role, "content": rng.choice(CONTENTS)}
        if role == "assistant":
            if rng.random() < 0.4:
                message["reasoning_content"] = rng.choice(["", "think", "\nstep\n", "a\n\nb"])
            if rng.random() < 0.4:
                arguments: Any = rng.choice([{"a": 1}, '{"a": 2}', {}])
                calls = [{"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": arguments}}
                         for i in range(rng.randint(1, 2))]  # fmt: skip
                message["tool_calls"] = calls
        messages.append(message)
    return messages


@pytest.mark.parametrize("seed", range(6))
def test_arl_qwen3_template_renders_as_qwen3s_own(seed: int) -> None:
    original = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")  # type: ignore[attr-defined]
    ours = chat_template("qwen3")
    rng = random.Random(seed)
    for _ in range(150):
        messages = _conversation(rng)
        tools = TOOLS if rng.random() < 0.5 else None
        prompt = rng.random() < 0.6
        extra = rng.choice([{}, {"enable_thinking": False}, {"enable_thinking": True}])
        assert _render(ours, messages, tools, prompt, extra) == _render(original, messages, tools, prompt, extra), (
            messages, tools, prompt, extra,
        )  # fmt: skip


def test_make_tiny_model_qwen3_wears_qwen3s_architecture_and_template(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.demo.tiny_model import make_tiny_model

    out = make_tiny_model(tmp_path / "q3", arch="qwen3", template="qwen3", num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    attention = model.model.layers[0].self_attn
    assert type(model).__name__ == "Qwen3ForCausalLM" and attention.q_norm is not None and attention.q_proj.bias is None
    tok = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == _render(chat_template("qwen3"), messages, None, False, {}) and "<think>\nr\n</think>" in rendered
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "bad", arch="gpt2")  # type: ignore[arg-type]


def test_arl_check_serves_qwen3s_template_and_says_how(tiny_qwen3_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3's template re-renders a first reply once a user follows (its empty think block goes): the launch
    check passes it and says what each `proxy.history` does; a template that does not render is still refused."""
    from pipeline.launch.preflight import check_template
    from pipeline.run.config import load_config

    outcome = check_template(load_config(None, [f"model.path={tiny_qwen3_dir}"]))
    assert not outcome.problems and "proxy.history: sampled keeps one row" in outcome.detail
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages[0].nope.nope }}")
    refused = check_template(load_config(None, [f"model.path={tiny_qwen3_dir}", f"model.chat_template={broken}"]))
    assert len(refused.problems) == 1 and "does not render" in refused.problems[0].message
