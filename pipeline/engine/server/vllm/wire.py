"""SGLang `/generate` work items to vLLM `/v1/completions` bodies, and vLLM choices back to SGLang responses.

Token-in/token-out: the prompt goes as a list of token ids (`prompt: [ids]`), and the server runs
with `--return-tokens-as-token-ids`, so every returned token is `token_id:<n>` and the ids are
exact (no re-tokenisation of text). `logprobs: 0` asks for the sampled token's logprob only;
`logprobs: k` (SGLang's `top_logprobs_num`) adds vLLM's per-position `top_logprobs` dicts, which hold
the sampled token as well as the k most likely, so they are sorted and cut back to k.

SGLang's input logprobs (`logprob_start_len` >= 0) are vLLM's `prompt_logprobs`: per prompt position a
dict {token id: {logprob, rank, ...}} holding the prompt's token (and the k most likely with
`prompt_logprobs: k`), None at position 0. vLLM computes them from the raw logits whatever
`--logprobs-mode` says (prompt tokens skip the sampling processors: no temperature), as SGLang does.
A request with prompt logprobs never reads vLLM's prefix cache (vLLM's rule), so every prompt is scored
by the weights served now. `max_new_tokens` 0 (scoring only) asks vLLM for one token, which is dropped.
Pure functions: unit-tested without a server.
"""

from __future__ import annotations

from typing import Any

from pipeline.engine.server.requests import PromptLogprobs, WorkItem
from pipeline.engine.tokens import TopEntry

_TOKEN_PREFIX = "token_id:"


def completion_body(item: WorkItem, served_name: str, *, stream: bool, cache_salt: str | None = None) -> dict[str, Any]:
    """The vLLM completion request for one work item (SGLang sampling names mapped to vLLM's).

    `cache_salt`: vLLM's prefix-cache salt; requests with different salts never share cached KV blocks."""
    params = item.params
    body: dict[str, Any] = {
        "model": served_name,
        "prompt": item.input_ids,
        "max_tokens": item.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,  # vLLM: 0 disables, SGLang: -1
        "min_p": params.min_p,
        # Sent although neutral: vLLM fills every field a request leaves out from the model's
        # generation_config.json (e.g. Qwen's repetition_penalty 1.05), which SGLang's protocol does not.
        "repetition_penalty": params.repetition_penalty,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "min_tokens": params.min_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
        "include_stop_str_in_output": params.no_stop_trim,
        "logprobs": item.top_logprobs_num,
        "return_tokens_as_token_ids": True,
        "n": 1,
        "stream": stream,
    }
    if params.stop_strings():
        body["stop"] = params.stop_strings()
    if params.stop_token_ids and not params.ignore_eos:  # SGLang's ignore_eos disables them; vLLM's does not
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.sampling_seed is not None:
        body["seed"] = params.sampling_seed
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if item.logprob_start_len >= 0:
        body["prompt_logprobs"] = item.top_logprobs_num
        body["max_tokens"] = max(item.max_new_tokens, 1)  # vLLM refuses 0; the caller drops the token
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def choice_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of a completion choice (or a streamed delta of one)."""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    ids = [parse_token(t) for t in tokens]
    return ids, [float(v) if v is not None else float("nan") for v in values]


def choice_top(choice: dict[str, Any], k: int) -> list[TopEntry]:
    """The k most likely (logprob, token id) of each position of a choice, most likely first."""
    positions = (choice.get("logprobs") or {}).get("top_logprobs") or []
    out = []
    for position in positions:
        pairs = [(float(lp), parse_token(tok)) for tok, lp in (position or {}).items()]
        out.append(sorted(pairs, key=lambda pair: -pair[0])[:k])
    return out


def prompt_scores(choice: dict[str, Any], item: WorkItem) -> PromptLogprobs:
    """SGLang's input logprobs of `item.input_ids[logprob_start_len:]` from a choice's `prompt_logprobs`:
    the first scored position None (as SGLang, whatever the start), then each prompt token's logprob."""
    start, ids, k = item.logprob_start_len, item.input_ids, item.top_logprobs_num
    if start >= len(ids):
        return PromptLogprobs([], [])
    positions = choice.get("prompt_logprobs")
    if not positions or len(positions) != len(ids):
        got = "none" if not positions else len(positions)
        raise ValueError(f"vLLM returned {got} prompt logprobs for a prompt of {len(ids)} tokens")
    values: list[float | None] = [None]
    top: list[TopEntry | None] = [None] if k > 0 else []
    for token, position in zip(ids[start + 1 :], positions[start + 1 :], strict=True):
        values.append(float(position[str(token)]["logprob"]))
        if k > 0:
            pairs = [(float(entry["logprob"]), int(tok)) for tok, entry in position.items()]
            top.append(sorted(pairs, key=lambda pair: -pair[0])[:k])
    return PromptLogprobs(values, top)


def parse_token(token: str) -> int:
    if not token.startswith(_TOKEN_PREFIX):
        raise ValueError(
            f"vLLM returned token {token!r}, not 'token_id:<n>': start it with --return-tokens-as-token-ids"
        )
    return int(token[len(_TOKEN_PREFIX) :])


def finish_reason(choice: dict[str, Any], output_ids: list[int], stop_ids: set[int]) -> dict[str, Any] | None:
    """SGLang's `finish_reason` from vLLM's `finish_reason` + `stop_reason`."""
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "stop":
        matched = choice.get("stop_reason")
        if matched is None and output_ids and output_ids[-1] in stop_ids:
            matched = output_ids[-1]  # EOS: vLLM reports no stop_reason for it
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": f"vLLM finish_reason {reason!r}"}
