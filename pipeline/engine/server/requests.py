"""SGLang `/generate` requests in, engine work items out; finished work back to SGLang's response shape.

Everything here is pure (no model, no HTTP), so the validation rules are unit-tested directly:
a request the engine cannot serve is refused here with a message naming the field and the value,
before anything reaches a backend. Shapes and rules: docs/inference.md, "POST /generate".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipeline.engine.tokens import TopEntry, version_spans
from schemas.engine_api import GenerateReqInput, SamplingParams


class RequestError(ValueError):
    """The request is malformed or cannot be served: the caller's error, answered with HTTP 400.

    Raised by the app's body parsing and by backends alike; the app picks the error body by the route
    (`/generate`: `{"error": {...}}`, admin routes: SGLang's `{"success": false, "message"}`).
    """


@dataclass
class WorkItem:
    """One completion to produce: a prompt, its sampling parameters and where the answer goes."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    return_logprob: bool
    top_logprobs_num: int = 0
    """k most likely tokens per output position (`meta_info.output_top_logprobs`); 0 = none, no cost."""
    logprob_start_len: int = -1
    """First prompt position scored in `meta_info.input_token_logprobs`; -1 = none (only with `return_logprob`)."""
    lora: str | None = None
    """The loaded LoRA adapter that serves it (`lora_path`); None: the base model."""
    routed_experts_start: int = -1
    """First position of `meta_info.routed_experts` (`return_routed_experts`); -1 = not asked."""


@dataclass(frozen=True)
class PromptLogprobs:
    """A scored prompt, SGLang's layout: one entry per token of `input_ids[logprob_start_len:]`."""

    logprobs: list[float | None]
    """The first is None (SGLang gives the first scored position no logprob); then each token's logprob."""
    top: list[TopEntry | None]
    """Per position, its `top_logprobs_num` most likely tokens (None first); empty when none were asked."""


@dataclass
class Limits:
    vocab_size: int
    max_context: int


def expand(req: GenerateReqInput, limits: Limits, tokenizer: Any) -> list[WorkItem]:
    """The work items of a request: one per prompt and per sample (`n`), prompt-major."""
    prompts = _prompts(req, tokenizer)
    count = len(prompts)
    params = [_sampling(raw, i) for i, raw in enumerate(_per_prompt(req.sampling_params, count, "sampling_params", {}))]
    logprob_flags = _per_prompt(req.return_logprob, count, "return_logprob", False)
    tops = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    starts = _per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    rids = _rids(req.rid, count)
    loras = _per_prompt(req.lora_path, count, "lora_path", None)
    items: list[WorkItem] = []
    for index, (prompt, sp, want_lp, top, start, rid, lora) in enumerate(
        zip(prompts, params, logprob_flags, tops, starts, rids, loras, strict=True)
    ):
        _check_prompt(prompt, index, limits)
        where = f" for prompt {index}" if count > 1 else ""
        if top and not want_lp:
            raise RequestError(f"top_logprobs_num={top}{where} needs return_logprob=true (top logprobs come with it)")
        start = int(start) if want_lp else -1  # SGLang ignores logprob_start_len without return_logprob
        if start > len(prompt):
            raise RequestError(
                f"logprob_start_len={start}{where} is past the prompt's {len(prompt)} tokens; use 0..{len(prompt)}"
            )
        # Like SGLang: the completion is clipped to what fits in the context, not refused.
        max_new = min(sp.max_new_tokens, limits.max_context - len(prompt))
        routed = _routed_start(req, len(prompt), where)
        rids_of = [rid] if sp.n == 1 else [f"{rid}_{j}" for j in range(sp.n)]
        items.extend(
            WorkItem(
                rid=r,
                input_ids=prompt,
                params=sp,
                max_new_tokens=max_new,
                return_logprob=bool(want_lp),
                top_logprobs_num=int(top),
                logprob_start_len=start,
                lora=lora,
                routed_experts_start=routed,
            )
            for r in rids_of
        )
    if req.stream and len(items) != 1:
        raise RequestError(f"stream=true needs one prompt with n=1; this request expands to {len(items)} completions")
    return items


def _routed_start(req: GenerateReqInput, prompt_len: int, where: str) -> int:
    """`routed_experts_start_len` when `return_routed_experts`, else -1; in [0, prompt length] as SGLang requires."""
    if not req.return_routed_experts:
        return -1
    start = req.routed_experts_start_len
    if not 0 <= start <= prompt_len:
        raise RequestError(
            f"routed_experts_start_len={start}{where} must be in [0, {prompt_len}] (the prompt's tokens)"
        )
    return start


def _prompts(req: GenerateReqInput, tokenizer: Any) -> list[list[int]]:
    if req.input_ids is not None:
        if not req.input_ids:
            raise RequestError("input_ids is empty: give at least one token id")
        ids = req.input_ids
        return [list(p) for p in ids] if isinstance(ids[0], list) else [list(ids)]  # type: ignore[arg-type]
    texts = [req.text] if isinstance(req.text, str) else list(req.text or [])
    if not texts:
        raise RequestError("text is empty")
    return [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]


def _sampling(raw: dict[str, Any], index: int) -> SamplingParams:
    try:
        return SamplingParams.model_validate(raw)
    except ValidationError as exc:
        where = f"sampling_params[{index}]" if index else "sampling_params"
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or where}: {e['msg']}" for e in exc.errors())
        raise RequestError(f"invalid {where}: {problems}") from None


def _per_prompt(value: Any, count: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise RequestError(f"{name} has {len(value)} entries but the request has {count} prompts")
    return value


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if count == 1 else [f"{base}_{i}" for i in range(count)]
    if isinstance(rid, str):
        return [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]
    if len(rid) != count or len(set(rid)) != count:
        raise RequestError(f"rid must hold {count} distinct ids (one per prompt), got {rid!r}")
    return list(rid)


def _check_prompt(prompt: list[int], index: int, limits: Limits) -> None:
    where = f"prompt {index}" if index else "the prompt"
    if not prompt:
        raise RequestError(f"{where} is empty: give at least one token id")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"{where} holds token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:10]}")
    if len(prompt) >= limits.max_context:
        raise RequestError(
            f"{where} has {len(prompt)} tokens but the context holds {limits.max_context} "
            "(prompt + completion); shorten the prompt or raise model.max_context"
        )


def stop_token_ids(params: SamplingParams, eos_ids: set[int]) -> set[int]:
    """Tokens that end generation: `stop_token_ids` and EOS, unless `ignore_eos` (SGLang disables both)."""
    if params.ignore_eos:
        return set()
    return set(params.stop_token_ids or []) | eos_ids


def finish_text(text: str, finish: dict[str, Any] | None, params: SamplingParams) -> str:
    """Cut `text` at a matched stop string (kept with `no_stop_trim`), as SGLang does."""
    if finish and isinstance(finish.get("matched"), str) and not params.no_stop_trim:
        cut = text.find(finish["matched"])
        if cut >= 0:
            return text[:cut]
    return text


@dataclass(frozen=True)
class Produced:
    """What one completion has produced so far (cumulative), the content of its `response`."""

    output_ids: list[int]
    """Every token sampled so far."""
    logprobs: list[float]
    """Their log-probs, one per token."""
    finish: dict[str, Any] | None
    """SGLang's `finish_reason` once the completion has ended, else None."""
    weight_version: int
    """The weights of the latest event (SGLang's `meta_info.weight_version`)."""
    top_logprobs: list[TopEntry] | None = None
    """Per output token, its `top_logprobs_num` most likely tokens (sent only when the item asked for them)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The scored prompt (`item.logprob_start_len` >= 0); None before the engine has scored it."""
    versions: list[int] | None = None
    """The weight version of each output token, sent as arl's `meta_info.weight_version_spans`; None: not sent."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (SGLang's `meta_info.cached_tokens`)."""
    routed_experts: str | None = None
    """SGLang's `meta_info.routed_experts` (base64), once the completion has finished, when it was asked."""


def response(
    item: WorkItem, produced: Produced, tokenizer: Any, *, text_in_logprobs: bool = False, include_text: bool = True
) -> dict[str, Any]:
    """SGLang's response object for one completion (cumulative: everything produced so far).

    The scored prompt goes in `meta_info.input_token_logprobs` (and `input_top_logprobs` with top logprobs);
    the per-token versions in arl's `meta_info.weight_version_spans` (`version_spans`), SGLang's own
    `weight_version` being the newest.
    """
    output_ids, logprobs, finish = produced.output_ids, produced.logprobs, produced.finish
    prompt_logprobs, versions = produced.prompt_logprobs, produced.versions
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": len(item.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": produced.cached_tokens,
        "weight_version": str(produced.weight_version),
    }
    if versions is not None:
        meta["weight_version_spans"] = version_spans(versions)
    if produced.routed_experts is not None:
        meta["routed_experts"] = produced.routed_experts
    if item.return_logprob and item.logprob_start_len >= 0 and prompt_logprobs is not None:
        scored = item.input_ids[item.logprob_start_len :]
        meta["input_token_logprobs"] = [
            [lp, tok, tokenizer.decode([tok]) if text_in_logprobs else None]
            for lp, tok in zip(prompt_logprobs.logprobs, scored, strict=True)
        ]
        if item.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if entry is None else top_entries([entry], tokenizer, text_in_logprobs)[0]
                for entry in prompt_logprobs.top
            ]
    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, tokenizer.decode([tok]) if text_in_logprobs else None]
            for lp, tok in zip(logprobs, output_ids, strict=True)
        ]
        if item.top_logprobs_num > 0:
            meta["output_top_logprobs"] = top_entries(produced.top_logprobs or [], tokenizer, text_in_logprobs)
    text = None
    if include_text:
        raw = tokenizer.decode(
            output_ids,
            skip_special_tokens=item.params.skip_special_tokens,
            spaces_between_special_tokens=item.params.spaces_between_special_tokens,
        )
        text = finish_text(raw, finish, item.params)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def top_entries(top: list[TopEntry], tokenizer: Any, text_in_logprobs: bool) -> list[list[list[Any]]]:
    """SGLang's `output_top_logprobs`: per position, `[logprob, token_id, text or null]`, most likely first."""
    return [[[lp, tok, tokenizer.decode([tok]) if text_in_logprobs else None] for lp, tok in entry] for entry in top]


def splice_top(body: str, positions: list[str]) -> str:
    """Add `output_top_logprobs` (each position already JSON-encoded) to the JSON text of a response.

    Why: a cumulative stream resends every position's k entries with each token; encoding each
    position once and joining the encoded texts keeps a long stream's cost on the server's event loop
    to copying bytes instead of re-encoding O(tokens x k) objects per event. `body` is `json.dumps` of
    a `response()` dict, whose last key is `meta_info` (so the text ends with two closing braces).
    """
    if not body.endswith("}}"):
        raise ValueError("splice_top needs the JSON of a response() object (meta_info last)")
    return f'{body[:-2]}, "output_top_logprobs": [{", ".join(positions)}]}}}}'
