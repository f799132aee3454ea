"""Build a tiny random-init chat model (Qwen2, Qwen3 or Qwen3-MoE architecture) and its tokenizer, offline.

The model exists so that every stage (engines, proxy, trainer) and every test can run a real
Hugging Face checkpoint on a laptop with no hub access. It is small enough to learn a toy task
with RL on a CPU in minutes (vocab 512, 2 layers, hidden 128: ~0.6M parameters, ~2.3 MB).

Three chat formats share the tokenizer: ``qwen`` (Qwen2.5 template, Hermes ``<tool_call>``
JSON), ``qwen3`` (Qwen3's: reasoning in ``<think>`` blocks, dropped from turns before the last user
query) and ``llama3`` (Llama 3.1 template, bare JSON tool calls, ``ipython`` tool role), so
template- and parser-dependent code can be tested against each.

Why the tokenizer pipeline is Qwen's exactly: transformers 5 loads any ``qwen2`` checkpoint's
tokenizer as ``Qwen2Tokenizer``, which rebuilds the normalizer, pre-tokenizer and decoder from
its own code. A tokenizer trained with any other pre-tokenizer would give different ids after
``AutoTokenizer.from_pretrained``; with Qwen's pipeline the ids from raw ``tokenizers``,
``AutoTokenizer`` and vLLM agree.

Builds are deterministic: the same arguments give byte-identical files. The tokenizer does not
depend on ``seed`` (only the weights do), so models built with different seeds share ids.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Literal

Template = Literal["qwen", "llama3", "qwen3"]
Arch = Literal["qwen2", "qwen3", "qwen3_moe"]
ARCHS: tuple[Arch, ...] = ("qwen2", "qwen3", "qwen3_moe")
TINY_EXPERTS, TINY_EXPERTS_PER_TOKEN = 4, 2
"""The tiny mixture-of-experts: a router over 4 experts a layer, each token sent to 2 (weights renormalised)."""

# Qwen's pre-tokenizer regex, copied from transformers' Qwen2Tokenizer (see module docstring).
# Digits are split one per token, so numbers tokenise uniformly.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT_ID = "<|eot_id|>"
PYTHON_TAG = "<|python_tag|>"

# Control tokens: special=True, so decode(skip_special_tokens=True) drops them.
QWEN_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
LLAMA3_SPECIAL_TOKENS = (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT_ID, PYTHON_TAG)
# Markup the model writes as text: special=False (as in Qwen2.5/Qwen3), so tool calls and
# reasoning survive decode(skip_special_tokens=True) and reach the parsers.
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "<think>",
    "</think>",
)

_HEADS = 4
_KV_HEADS = 2
_CORPUS_SEED = 1234  # fixed: the tokenizer must not change with the weight seed
_CORPUS_WORDS = (
    "the a of and to in is you that it was for on are as with they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like into time "
    "has look two more write go see number no way could people my than first water been call who "
    "now find long down day did get come made may part answer question add sum result user "
    "assistant system tool function call weather city search file read value error true false"
)


def make_tiny_model(
    out_dir: str | Path,
    *,
    template: Template = "qwen",
    num_layers: int = 2,
    hidden_size: int = 128,
    seed: int = 0,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    overwrite: bool = False,
    arch: Arch = "qwen2",
) -> Path:
    """Write a random-init checkpoint with tokenizer to ``out_dir``: ``arch`` ``qwen2`` (``Qwen2ForCausalLM``),
    ``qwen3`` (Qwen3's attention: q/k RMS norms, no qkv bias) or ``qwen3_moe`` (Qwen3-MoE: every layer's MLP a
    router over `TINY_EXPERTS` experts, top-`TINY_EXPERTS_PER_TOKEN`, weights renormalised as Qwen3-MoE's are).

    The directory holds config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and chat_template.jinja. It is built in a sibling temp directory and
    renamed into place, so a reader never sees a half-written model. Returns ``out_dir``.
    """
    out = Path(out_dir).resolve()
    _check_args(out, template, hidden_size, vocab_size, overwrite, arch)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = build_tokenizer(template, vocab_size)
        token_ids = _save_tokenizer(tokenizer, tmp, template, max_position_embeddings)
        _save_model(
            tmp,
            token_ids,
            num_layers=num_layers,
            hidden_size=hidden_size,
            seed=seed,
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            arch=arch,
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def chat_template(template: Template) -> str:
    """The Jinja chat template text for ``template`` (files under pipeline/templates/)."""
    return (resources.files("pipeline.templates") / f"{template}.jinja").read_text(encoding="utf-8")


def special_tokens(template: Template | str) -> tuple[str, ...]:
    """All added tokens of ``template``'s tokenizer, in id order (they take the last ids)."""
    llama = LLAMA3_SPECIAL_TOKENS if template == "llama3" else ()
    return QWEN_SPECIAL_TOKENS + MARKUP_TOKENS + llama


def _check_args(out: Path, template: str, hidden_size: int, vocab_size: int, overwrite: bool, arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: use one of {', '.join(ARCHS)}")
    if template not in ("qwen", "llama3", "qwen3"):
        raise ValueError(f"unknown template {template!r}: use 'qwen', 'qwen3' or 'llama3'")
    if hidden_size % (2 * _HEADS) != 0:
        # rotary embeddings need an even head dim, and there are _HEADS heads
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of {2 * _HEADS}")
    smallest = 256 + len(special_tokens(template)) + 1  # byte alphabet + added tokens + one merge
    if vocab_size < smallest:
        raise ValueError(f"vocab_size={vocab_size} is too small for template {template!r}: use >= {smallest}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"model directory exists and is not empty: {out} (pass overwrite=True / --overwrite)")


# --------------------------------------------------------------------------- tokenizer


def _corpus(num_lines: int) -> list[str]:
    """Generated training text: prose, arithmetic, JSON tool calls, python, a little unicode.

    It only has to give BPE sensible merges (common words, ``": "``, indentation) so that the
    toy tasks the demos use (arithmetic, JSON tool calls) tokenise into short sequences.
    """
    rng = random.Random(_CORPUS_SEED)
    words = _CORPUS_WORDS.split()
    names = ("add", "multiply", "get_weather", "search", "read_file", "calculator", "lookup")
    code = (
        "def {f}(a, b):\n    return a + b\n",
        "for i in range({n}):\n    print(i)\n",
        "if x > {n}:\n    y = x * 2\nelse:\n    y = None\n",
        'import json\n\ndata = json.loads(text)\nresult = data["{w}"]\n',
        "class {F}:\n    def __init__(self, value):\n        self.value = value\n",
    )
    unicode = ("café", "naïve", "über", "señor", "日本語", "→", "é", "ü", "—", "“quoted”")
    lines: list[str] = []
    for _ in range(num_lines):
        a, b, w = rng.randrange(100), rng.randrange(100), rng.choice(words)
        kind = rng.randrange(6)
        if kind == 0:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 14)))
            lines.append(sentence.capitalize() + rng.choice((".", "?", "!", ",")))
        elif kind == 1:
            op, res = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
            lines.append(rng.choice((f"{a}{op}{b}={res}", f"What is {a} {op} {b}? The answer is {res}.")))
        elif kind == 2:
            args = {"a": a, "b": b} if rng.random() < 0.5 else {"query": w, "limit": b, "exact": a > 50}
            lines.append(json.dumps({"name": rng.choice(names), "arguments": args}))
        elif kind == 3:
            lines.append(json.dumps({"result": a + b, "items": [a, b], "ok": True, "error": None, "text": w}))
        elif kind == 4:
            f = rng.choice(names)
            lines.append(rng.choice(code).format(f=f, F=f.title().replace("_", ""), n=a, w=w))
        else:
            lines.append(" ".join(rng.choice(words + list(unicode)) for _ in range(8)))
    return lines


def build_tokenizer(template: Template = "qwen", vocab_size: int = 512) -> Any:
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) with the added tokens.

    The BPE vocabulary gets ``vocab_size - len(special_tokens(template))`` entries so that the
    added tokens take the last ids and ``len(tokenizer) == config.vocab_size`` (if the corpus
    runs out of merges first, the tokenizer is smaller and the top embedding rows go unused).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = special_tokens(template)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    # ~30 characters a line: enough text for the requested number of merges, still a fraction of a second
    tokenizer.train_from_iterator(_corpus(max(400, 2 * vocab_size)), trainer)
    specials = set(QWEN_SPECIAL_TOKENS + LLAMA3_SPECIAL_TOKENS)
    tokenizer.add_tokens([AddedToken(t, special=t in specials, normalized=False) for t in added])
    return tokenizer


def _token_ids(tokenizer: Any, template: Template) -> dict[str, Any]:
    """bos/eos/pad ids for config.json and generation_config.json."""
    tid = tokenizer.token_to_id
    if template == "llama3":
        # Llama 3.1 Instruct: bos <|begin_of_text|>, turns end with <|eot_id|>
        return {
            "bos": tid(BEGIN_OF_TEXT),
            "eos": tid(EOT_ID),
            "eos_all": [tid(EOT_ID), tid(ENDOFTEXT)],
            "pad": tid(ENDOFTEXT),
        }
    # Qwen2.5 Instruct: config bos = <|endoftext|>, eos = <|im_end|>, generation stops on both
    return {"bos": tid(ENDOFTEXT), "eos": tid(IM_END), "eos_all": [tid(IM_END), tid(ENDOFTEXT)], "pad": tid(ENDOFTEXT)}


def _save_tokenizer(tokenizer: Any, out: Path, template: Template, max_length: int) -> dict[str, Any]:
    """Save through transformers so the files are in the layout it (and vLLM) reads back."""
    from transformers import PreTrainedTokenizerFast

    llama = template == "llama3"
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BEGIN_OF_TEXT if llama else None,
        eos_token=EOT_ID if llama else IM_END,
        pad_token=ENDOFTEXT,
        # Llama 3 prepends <|begin_of_text|> on encode (the chat template writes it itself and
        # apply_chat_template encodes without special tokens); Qwen adds nothing. This lands in
        # tokenizer.json's post-processor, which transformers 5 treats as the truth on reload (it
        # drops add_bos_token from tokenizer_config.json), so `tok.add_bos_token` reads False.
        add_bos_token=llama,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
        model_max_length=max_length,
        chat_template=chat_template(template),
    )
    wrapped.save_pretrained(str(out))
    # Name the class real Qwen checkpoints name (transformers writes its generic backend class).
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return _token_ids(wrapped.backend_tokenizer, template)


# --------------------------------------------------------------------------- model


def _save_model(
    out: Path,
    token_ids: dict[str, Any],
    *,
    num_layers: int,
    hidden_size: int,
    seed: int,
    vocab_size: int,
    max_position_embeddings: int,
    arch: Arch = "qwen2",
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
        dtype="float32",
    )
    if arch == "qwen2":
        config: Any = Qwen2Config(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden_size // _HEADS)
    else:
        config = Qwen3MoeConfig(
            **common,
            num_experts=TINY_EXPERTS,
            num_experts_per_tok=TINY_EXPERTS_PER_TOKEN,
            moe_intermediate_size=2 * hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    # fork_rng: seed the init without disturbing the caller's global RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()  # even if the caller changed the default dtype
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos_all"], pad_token_id=token_ids["pad"]
    )
    model.save_pretrained(str(out))
