"""Chat templating and the token-exact prefix logic (docs/proxy.md, "Token-exact multi-turn").

The first call of a conversation renders the model's chat template and tokenizes it. A later call
that *extends* an earlier interaction (same messages + the assistant message the proxy returned +
new messages) is never re-tokenized: its prompt is the earlier prompt tokens + the tokens the model
actually sampled + the tokens of the new suffix only, so the trained tokens are the sampled ones.

Finding the suffix. Render the full conversation F (with the generation prompt) and the prefix
conversation P (up to and including the returned assistant message, no generation prompt). When F
starts with P, the new text is F[len(P):]. But P ends with the template's *turn close* after the
assistant content, e.g. Qwen's `<|im_end|>\\n` or Llama 3's `<|eot_id|>`, and the model generated
only part of it: it stopped *at* `<|im_end|>`. The rest of the close (Qwen's `\\n`) was never
sampled, so it belongs to the new suffix. Dropping it (taking F[len(P):] alone) silently loses a
`\\n` per turn and trains the model on sequences it never sees at inference: the trap this module
exists to avoid. If generation ended without the end-of-turn token (length limit, stop string), the
whole close is added, so the engine still sees well-formed turns.

Rendering only what is new. Rendering the whole history on every call costs time in proportion to
its length. With the parent's rendered text kept, a template that passes the start-up probes of
template_probe.py gets P from that text + the assistant turn (turn-local), and the new text from
a render of a short window: a stand-in user turn + the assistant message + the new messages
(suffix-local). A sample of these window renders is checked against full renders. Templates that
fail a probe render the whole conversation once or twice; all paths give the same text.

Tokenizing fast and exactly. A tokenizer first cuts its input at added tokens (`<|im_end|>`,
`<tool_call>`, ...) and encodes the pieces between independently, so encoding piece by piece is the
same as encoding the whole text. Pieces repeat across sessions (system prompt, tool schemas), so
they are cached. The cut is only used when every added token is plain (no lstrip/rstrip/
single_word/normalized flags); otherwise the whole text is encoded.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.proxy import template_probe, template_style
from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.literal import LiteralSpecials
from pipeline.proxy.messages import Message

log = logging.getLogger("arl.proxy.tokenize")

_SENTINEL = "\x00ARL_SENTINEL\x00"
_CACHE_ENTRIES = 8192
_CACHE_MAX_CHARS = 65536  # pieces longer than this are encoded but not cached
_VERIFY_EVERY = 64  # window renders per check against a full render (the first one is always checked)
_GIL_FREE_CHARS = 16384  # texts longer than this are encoded with the GIL released (`_encode_raw`)


@dataclass(frozen=True)
class Extension:
    """How a request's prompt is built from an earlier interaction's tokens."""

    suffix_ids: list[int]
    """Tokens after the earlier prompt + output: the unsampled rest of the turn close + new messages."""
    close_tail: str
    """The part of the template's turn close the model did not generate (Qwen: "\\n")."""
    full_text: str
    """The rendered conversation with its generation prompt (kept for the next turn's fast path)."""
    suffix_text: str
    """The text of `suffix_ids`: the unsampled close, the new messages, the generation prompt (no prefill)."""


class ChatTokenizer:
    """A tokenizer + chat template with the token-exact extension logic of the module docstring."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        chat_template: str | Path | None = None,
        model_dir: str | Path | None = None,
        *,
        loaded: Any = None,
        special_tokens_in_content: str = "text",
    ) -> None:
        """`loaded`: the tokenizer at `tokenizer_path` already loaded by `AutoTokenizer` (not loaded again);
        `special_tokens_in_content`: `text` (special-token strings in messages are text, `pipeline.proxy.literal`)
        or `special` (encoded as the special tokens, as vLLM and SGLang do)."""
        from transformers import AutoTokenizer
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.path = str(tokenizer_path)
        self.hf = loaded if loaded is not None else AutoTokenizer.from_pretrained(self.path)
        text = Path(chat_template).read_text(encoding="utf-8") if chat_template else self.hf.chat_template
        if not isinstance(text, str) or not text:
            raise ValueError(f"tokenizer at {self.path} has no chat template: set model.chat_template to a .jinja file")
        self.template_text = text
        try:
            self._template = _compile_jinja_template(text)
        except Exception as exc:  # a syntax error in a user's .jinja file
            raise template_style.UnsupportedTemplate(
                f"the chat template of {self.path} does not compile: {exc}"
            ) from None
        self._special = {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        self._backend = self.hf.backend_tokenizer
        self._added: dict[str, int] = {tok.content: idx for idx, tok in self.hf.added_tokens_decoder.items()}
        self._splitter = _added_token_splitter(self.hf.added_tokens_decoder.values())
        self._literal = _literal_specials(self, special_tokens_in_content)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)
        """The longest token's text (in characters of its vocabulary entry, byte-level or not): a prompt of C
        characters is at least C / max_token_chars tokens."""
        self.stop_token_ids = _stop_token_ids(self.hf, Path(model_dir or self.path))
        self.style = template_style.detect(self._render_raw, self.path)
        try:
            self.close_text = self._detect_turn_close()
            self._window_text = self.render(template_probe.WINDOW, None, add_generation_prompt=False)
        except ApiError as exc:
            raise template_style.UnsupportedTemplate(f"the chat template of {self.path}: {exc.message}") from None
        self._turns: OrderedDict[str, str] = OrderedDict()
        self.generation_prompt = template_probe.generation_prompt(self)
        self.turn_local = template_probe.turn_local(self)
        self.suffix_local = self.turn_local and template_probe.suffix_local(self)
        self.verify_every = _VERIFY_EVERY
        self._windowed = 0

    # -- rendering ------------------------------------------------------------------------
    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        """The template's text for a conversation; template errors become a 400 saying why."""
        if self._literal is not None:
            messages = self._literal.escape_messages(messages)
        try:
            return self._render_raw(self.style.adapt(messages), tools, add_generation_prompt)
        except Exception as exc:  # raise_exception's TemplateError, or a TypeError of a template meeting a shape
            detail = str(exc).strip().splitlines()
            raise bad_request(
                f"the model's chat template refused this conversation: {type(exc).__name__}: "
                f"{detail[0] if detail else ''}",
                param="messages",
            ) from None

    def _render_raw(self, messages: Sequence[Message], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            tools=list(tools) if tools else None,
            add_generation_prompt=generation_prompt,
            **self._special,
        )

    def _detect_turn_close(self) -> str:
        """The text the template writes after an assistant message's content (`<|im_end|>\\n`)."""
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(conv, None, add_generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError(f"chat template of {self.path} does not render assistant content verbatim")
        return text[text.index(_SENTINEL) + len(_SENTINEL) :]

    # -- tokens ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (templates write BOS themselves)."""
        if self._splitter is None:
            return self._encode_raw(text)
        ids: list[int] = []
        for piece in self._splitter.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                ids.append(added)
            elif self._literal is not None and self._literal.holds_placeholder(piece):
                ids.extend(self._literal.encode(piece))
            else:
                ids.extend(self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        # A large prompt is prepared in a worker thread (`Generator.prepare_soon`) while the event loop prepares
        # others: the cache's read-then-reorder must not interleave with an eviction.
        with self._cache_lock:
            cached = self._cache.get(piece)
            if cached is not None:
                self._cache.move_to_end(piece)
                return cached
        ids = self._encode_raw(piece)
        if len(piece) <= _CACHE_MAX_CHARS:
            with self._cache_lock:
                self._cache[piece] = ids
                if len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return ids

    def _encode_raw(self, text: str) -> list[int]:
        """The backend's ids. A long text goes through `encode_batch`, which releases the GIL while Rust works
        (`encode` holds it: measured, 3 s for 2 MB with no other Python thread running), so a prompt tokenized
        in a worker thread does not stop the event loop. Same ids either way."""
        if len(text) > _GIL_FREE_CHARS:
            return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as the model would read it (added tokens verbatim)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    # -- prompts --------------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None, prefill: str = "") -> list[int]:
        """A full render + tokenization (a conversation's first call, or after a prefix break)."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True) + prefill)

    def extend(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None,
        prefix_len: int,
        parent_output_ids: Sequence[int],
        prefill: str = "",
        parent_text: str | None = None,
        keep_sampled: bool = False,
    ) -> Extension | None:
        """The suffix tokens for `messages`, whose first `prefix_len` messages end with the returned
        assistant message of an interaction that generated `parent_output_ids`.

        `parent_text` is the parent's own full render (its messages + generation prompt), given when
        `messages[:prefix_len - 1]` are exactly the parent's messages. With a turn-local template the
        prefix render is then built from it, and with a suffix-local one the new text comes from a
        window render too, so the history is rendered no more than it is tokenized (see
        template_probe.py). Otherwise the whole conversation is rendered once or twice.

        Returns None when the template is not prefix-stable for this conversation (rendering the
        longer conversation changes earlier text); the caller then re-renders in full and records
        a prefix break. With `keep_sampled` (`proxy.history: sampled`) the new messages' text is then found
        in the longer rendering (`template_style.text_after_turn`) and the history stays the sampled tokens.
        """
        prefix_text = turn = None
        if parent_text is not None and self.turn_local:
            turn = self.assistant_turn(messages[prefix_len - 1])
            prefix_text = self._prefix_from_parent(parent_text, turn)
        if prefix_text is not None and turn is not None and self.suffix_local:
            new_text = self._windowed_suffix(messages, tools, prefix_len, prefix_text, turn)
            if new_text is not None:
                return self._extension(prefix_text, new_text, parent_output_ids, prefill)
        full_text = self.render(messages, tools, add_generation_prompt=True)
        if prefix_text is None or not full_text.startswith(prefix_text):
            prefix_text = self.render(messages[:prefix_len], tools, add_generation_prompt=False)
        if full_text.startswith(prefix_text):
            return self._extension(prefix_text, full_text[len(prefix_text) :], parent_output_ids, prefill)
        new_text = None
        if keep_sampled:  # self.render: the template's errors as 400s, special-token text in messages escaped
            new_text = template_style.text_after_turn(
                self.render, self.close_text, messages, tools, prefix_len, full_text
            )
        return None if new_text is None else self._extension(prefix_text, new_text, parent_output_ids, prefill)

    def _extension(
        self, prefix_text: str, new_text: str, parent_output_ids: Sequence[int], prefill: str
    ) -> Extension | None:
        if not prefix_text.endswith(self.close_text):
            return None
        tail = self.close_tail(parent_output_ids)
        suffix = tail + self._after_stop(parent_output_ids, new_text)
        return Extension(self.encode(suffix + prefill), tail, prefix_text + new_text, suffix)

    def _after_stop(self, output_ids: Sequence[int], new_text: str) -> str:
        """`new_text` less the sampled stop token where that token begins it: a template with no turn close (GLM)
        ends a turn where the next role's header begins, and its model stops by sampling that header."""
        if self.close_text or not output_ids or output_ids[-1] not in self.stop_token_ids:
            return new_text
        stop = self.token_text(output_ids[-1])
        return new_text[len(stop) :] if stop and new_text.startswith(stop) else new_text

    # -- the fast paths -----------------------------------------------------------------------
    def _prefix_from_parent(self, parent_text: str, turn: str | None) -> str | None:
        """render(parent messages + assistant) from the parent's render and the assistant's `turn`
        (turn-local templates)."""
        head = self.generation_prompt
        if turn is None or not head or not parent_text.endswith(head):
            return None
        return parent_text[: len(parent_text) - len(head)] + turn

    def _windowed_suffix(
        self, messages: Sequence[Message], tools: Sequence[dict] | None, prefix_len: int, prefix_text: str, turn: str
    ) -> str | None:
        """The new text of `messages` from a window render, or None to render in full.

        The probes cannot cover every conversation, so the first window render and every
        `verify_every`-th after it are compared with a full render; a difference turns the window
        off for good (logged without content) and that request is rendered in full.
        """
        try:
            new_text = self.render_after(messages[prefix_len - 1], messages[prefix_len:], turn)
        except ApiError:
            return None  # the full render decides whether the conversation is really refused
        if new_text is None:
            return None
        self._windowed += 1
        check = self.verify_every > 0 and (self._windowed - 1) % self.verify_every == 0
        if check and self.render(messages, tools, add_generation_prompt=True) != prefix_text + new_text:
            self.suffix_local = False
            log.warning(
                "the chat template renders new messages differently after a long history than in a short "
                "window: rendering whole conversations from now on (slower, still exact)"
            )
            return None
        return new_text

    def render_after(self, assistant: Message, new: Sequence[Message], turn: str | None = None) -> str | None:
        """What the template writes after `assistant` for the messages `new` and the generation prompt,
        rendered in a window where `template_probe.WINDOW` stands for the history (`turn`: the
        assistant's, if known)."""
        turn = turn if turn is not None else self.assistant_turn(assistant)
        if turn is None:
            return None
        base = self._window_text + turn
        text = self.render([*template_probe.WINDOW, assistant, *new], None, add_generation_prompt=True)
        return text[len(base) :] if text.startswith(base) else None

    def assistant_turn(self, assistant: Message) -> str | None:
        """The text of one assistant turn (header to close) as the template renders it after a user turn."""
        key = json.dumps(assistant, sort_keys=True, ensure_ascii=False)
        cached = self._turns.get(key)
        if cached is not None:
            return cached
        after = self.render([*template_probe.WINDOW, assistant], None, add_generation_prompt=False)
        if not after.startswith(self._window_text):
            return None
        turn = after[len(self._window_text) :]
        self._turns[key] = turn
        if len(self._turns) > _CACHE_ENTRIES:
            self._turns.popitem(last=False)
        return turn

    def close_tail(self, output_ids: Sequence[int]) -> str:
        """The part of the turn close the model did not sample, given what it generated."""
        if output_ids:
            last = output_ids[-1]
            text = self.token_text(last)
            if last in self.stop_token_ids and text and self.close_text.startswith(text):
                return self.close_text[len(text) :]
        return self.close_text


def _literal_specials(tok: ChatTokenizer, mode: str) -> LiteralSpecials | None:
    """What encodes special-token text in messages as text; None for `special`, or with nothing to escape."""
    if mode not in ("text", "special"):
        raise ValueError(f"special_tokens_in_content must be text or special, not {mode!r}")
    specials = [t.content for t in tok.hf.added_tokens_decoder.values() if t.special]
    if mode == "special" or not specials:
        return None
    if tok._splitter is None:
        log.warning(
            "%s: its added tokens strip whitespace or are normalized, so arl cannot keep special-token "
            "text in messages apart from the template's markup: it is encoded as special tokens",
            tok.path,
        )
        return None
    return LiteralSpecials(tok._backend, specials)


def _added_token_splitter(tokens: Any) -> re.Pattern[str] | None:
    """A regex cutting text at added tokens, longest first (as the tokenizer's own matcher does)."""
    contents = []
    for tok in tokens:
        if getattr(tok, "lstrip", False) or getattr(tok, "rstrip", False) or getattr(tok, "single_word", False):
            return None
        if getattr(tok, "normalized", False):
            return None
        contents.append(tok.content)
    if not contents:
        return None
    alternatives = "|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True))
    return re.compile(f"({alternatives})")


def _stop_token_ids(hf: Any, model_dir: Path) -> frozenset[int]:
    """End-of-generation ids: the tokenizer's eos plus generation_config.json's eos list."""
    ids: set[int] = set()
    if hf.eos_token_id is not None:
        ids.add(int(hf.eos_token_id))
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        value = json.loads(gen_config.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)
