"""The tiny offline model: determinism, tokenizer id identity, chat templates, loading."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.demo.tiny_model import make_tiny_model, special_tokens


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]

# One conversation that exercises everything the templates render: system, list-of-parts
# content, reasoning, two tool calls (JSON-string and mapping arguments), two consecutive tool
# results, a final answer with reasoning, and the generation prompt.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "2+3"}, {"type": "text", "text": "and 4+5?"}]},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 4, "b": 5}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "9"}]},
    {"role": "assistant", "content": "5 and 9.", "reasoning_content": "Done."},
    {"role": "user", "content": "Thanks"},
]

QWEN_EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n2+3\nand 4+5?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nDone.\n</think>\n\n5 and 9.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)

_LLAMA_TOOL_JSON = json.dumps(TOOLS[0], indent=4)
LLAMA3_EXPECTED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "Be brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n" + _LLAMA_TOOL_JSON + "\n\n2+3\nand 4+5?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\nUse the tool.\n</think>\n\n"
    '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 4, "b": 5}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
    "<|start_header_id|>ipython<|end_header_id|>\n\n9<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\nDone.\n</think>\n\n5 and 9.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)

VARIED_TEXTS = [
    "hello world",
    "Hello, World! What is 12+7? The answer is 19.",
    "12+7=19\n3*4=12\n100-1=99",
    '{"name": "add", "arguments": {"a": 12, "b": -7.5, "ok": true, "x": null}}',
    "def add(a, b):\n    return a + b\n\n\n\tindented\r\nwindows line",
    "   leading and trailing spaces   ",
    "café naïve über 日本語 → 😀 e\u0301 (decomposed é)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "f"}\n</tool_call><think>x</think><tools></tools>',
    "<|endoftext|><|endoftext|>text<|im_end|>",
    "don't you'll I'M it's",
    "",
]


def _dir_for(template: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir if template == "llama3" else tiny_model_dir


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(names)
    for name in names:
        assert _sha256(a / name) == _sha256(b / name), name


def test_different_seed_changes_weights_not_tokenizer(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=0)
    b = make_tiny_model(tmp_path / "b", seed=1)
    assert _sha256(a / "model.safetensors") != _sha256(b / "model.safetensors")
    assert _sha256(a / "tokenizer.json") == _sha256(b / "tokenizer.json")


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_raw_and_auto_tokenizer_ids_identical(template: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> None:
    model_dir = _dir_for(template, tiny_model_dir, tiny_llama_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert type(auto).__name__ == "Qwen2Tokenizer"  # what transformers 5 rebuilds for qwen2 checkpoints
    for text in VARIED_TEXTS:
        for special in (True, False):
            ids = auto(text, add_special_tokens=special)["input_ids"]
            assert ids == raw.encode(text, add_special_tokens=special).ids, (text, special)
        plain = raw.encode(text, add_special_tokens=False).ids
        assert auto.decode(plain) == raw.decode(plain, skip_special_tokens=False)
        if "\u0301" not in text:  # NFC changes decomposed characters, as it does for Qwen
            assert auto.decode(plain) == text
    rendered = auto.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    templated = auto.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert list(templated["input_ids"]) == raw.encode(rendered, add_special_tokens=False).ids


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_special_token_ids(template: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> None:
    model_dir = _dir_for(template, tiny_model_dir, tiny_llama_dir)
    auto = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    added = special_tokens(template)
    assert len(auto) == config["vocab_size"] == 512
    # added tokens take the last ids, in order, and each is one token when it appears in text
    assert [auto.convert_tokens_to_ids(t) for t in added] == list(range(512 - len(added), 512))
    for token in added:
        assert auto(token, add_special_tokens=False)["input_ids"] == [auto.convert_tokens_to_ids(token)]
    ids = {t: auto.convert_tokens_to_ids(t) for t in added}
    assert auto.pad_token == "<|endoftext|>"
    chat_eos = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    assert auto.eos_token == chat_eos
    assert config["eos_token_id"] == ids[chat_eos]
    assert generation["eos_token_id"] == [ids[chat_eos], ids["<|endoftext|>"]]
    # markup stays in decoded text (parsers need it); control tokens are dropped
    text = auto.decode([ids["<tool_call>"], ids["</think>"], ids["<|endoftext|>"]], skip_special_tokens=True)
    assert text == "<tool_call></think>"


def test_llama3_encode_prepends_bos_like_llama(tiny_llama_dir: Path, tiny_model_dir: Path) -> None:
    llama = AutoTokenizer.from_pretrained(tiny_llama_dir)
    qwen = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert llama("hi")["input_ids"][0] == llama.convert_tokens_to_ids("<|begin_of_text|>")
    assert qwen("hi")["input_ids"] == qwen("hi", add_special_tokens=False)["input_ids"]


def test_numbers_split_into_digits(tiny_model_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert auto.tokenize("12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    # the corpus taught BPE the JSON punctuation and common words
    assert len(auto.tokenize('{"name": "add", "arguments": {"a": 1}}')) <= 16


def test_qwen_template_renders_exact(tiny_model_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = auto.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered == QWEN_EXPECTED
    # without tools and system message: Qwen's default system message, no generation prompt
    plain = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_llama3_template_renders_exact(tiny_llama_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_llama_dir)
    rendered = auto.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered == LLAMA3_EXPECTED
    plain = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    )


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_history_renders_as_prefix(template: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> None:
    """Each turn's prompt + the generated reply is a prefix of the next turn's prompt (token-exact proxy)."""
    auto = AutoTokenizer.from_pretrained(_dir_for(template, tiny_model_dir, tiny_llama_dir))
    for cut in (2, 5):  # before each assistant message of CONVERSATION
        prompt = auto.apply_chat_template(CONVERSATION[:cut], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        longer = auto.apply_chat_template(CONVERSATION[: cut + 1], tools=TOOLS, tokenize=False)
        assert longer.startswith(prompt)


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_model_loads_and_generates(template: str, tiny_model_dir: Path, tiny_llama_dir: Path) -> None:
    import torch

    model_dir = _dir_for(template, tiny_model_dir, tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True)
    input_ids = torch.tensor([prompt["input_ids"]])
    out = model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, input_ids.shape[1] + 8)
    assert int(out.max()) < len(tok)


def test_model_directory_is_small(tiny_model_dir: Path) -> None:
    size = sum(p.stat().st_size for p in tiny_model_dir.iterdir())
    assert size < 5 * 1024 * 1024


def test_existing_directory_needs_overwrite(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path / "m", seed=0)
    before = _sha256(out / "model.safetensors")
    with pytest.raises(FileExistsError, match="overwrite"):
        make_tiny_model(out, seed=1)
    assert _sha256(out / "model.safetensors") == before
    make_tiny_model(out, seed=1, overwrite=True)
    assert _sha256(out / "model.safetensors") != before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp directory left behind


@pytest.mark.parametrize(
    "kwargs",
    [{"template": "mistral"}, {"hidden_size": 100}, {"vocab_size": 260}],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "m", **kwargs)


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: 10-20 s
def test_build_is_identical_in_a_fresh_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Byte-identical across processes, hash seeds and tokenizer thread counts (BPE training is threaded)."""
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1"}
    code = f"from pipeline.demo.tiny_model import make_tiny_model; make_tiny_model({str(tmp_path / 'm')!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _sha256(tmp_path / "m" / name) == _sha256(tiny_model_dir / name), name
