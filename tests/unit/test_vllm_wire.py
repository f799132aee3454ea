"""Mapping SGLang work items to vLLM completion bodies and vLLM choices back (no server needed)."""

from __future__ import annotations

import pytest

from pipeline.engine.server.requests import WorkItem
from pipeline.engine.server.vllm.wire import choice_tokens, choice_top, completion_body, finish_reason, prompt_scores
from schemas.engine_api import SamplingParams


def test_body_is_token_in_with_sglang_params_mapped():
    params = SamplingParams(
        max_new_tokens=9,
        temperature=0.5,
        top_k=-1,
        stop=["END"],
        stop_token_ids=[3],
        sampling_seed=4,
        no_stop_trim=True,
    )
    body = completion_body(WorkItem("r", [5, 6], params, 9, True), "policy", stream=True)
    assert body["prompt"] == [5, 6] and body["model"] == "policy" and body["max_tokens"] == 9
    assert body["top_k"] == 0  # vLLM's "off"
    assert body["stop"] == ["END"] and body["stop_token_ids"] == [3] and body["seed"] == 4
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["include_stop_str_in_output"] is True and body["stream_options"] == {"include_usage": True}
    assert "cache_salt" not in body
    assert (
        completion_body(WorkItem("r", [5], params, 9, True), "p", stream=True, cache_salt="arl-v3")["cache_salt"]
        == "arl-v3"
    )


def test_body_leaves_vllm_nothing_to_fill_in_and_ignore_eos_disables_stop_ids():
    """vLLM takes a field a body leaves out from the model's generation_config.json (e.g. repetition_penalty
    1.05), and its ignore_eos keeps stop_token_ids active; SGLang's protocol has neither."""
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[3], ignore_eos=True)
    body = completion_body(WorkItem("r", [5], params, 4, True), "p", stream=False)
    assert (body["repetition_penalty"], body["frequency_penalty"], body["presence_penalty"]) == (1.0, 0.0, 0.0)
    assert body["min_tokens"] == 0 and body["ignore_eos"] is True and "stop_token_ids" not in body


def test_choice_tokens_and_finish_reasons():
    choice = {
        "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-0.5, -0.1]},
        "finish_reason": "stop",
        "stop_reason": None,
    }
    ids, lps = choice_tokens(choice)
    assert ids == [7, 2] and lps == [-0.5, -0.1]
    assert finish_reason(choice, ids, {2}) == {"type": "stop", "matched": 2}  # EOS: vLLM gives no stop_reason
    assert finish_reason({**choice, "stop_reason": "END"}, ids, {2}) == {"type": "stop", "matched": "END"}
    assert finish_reason({"finish_reason": "length"}, ids, set()) == {"type": "length", "length": 2}
    assert finish_reason({"finish_reason": None}, ids, set()) is None
    assert finish_reason({"finish_reason": "abort"}, ids, set())["type"] == "abort"


def test_text_tokens_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="--return-tokens-as-token-ids"):
        choice_tokens({"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}})


def test_top_logprobs_map_to_vllm_logprobs_k_and_back():
    params = SamplingParams(max_new_tokens=2)
    assert completion_body(WorkItem("r", [5], params, 2, True, 3), "p", stream=False)["logprobs"] == 3
    # vLLM's dict per position holds the sampled token as well as the k most likely (here k = 2)
    choice = {"logprobs": {"tokens": ["token_id:9", "token_id:4"], "token_logprobs": [-3.0, -0.2],
                           "top_logprobs": [{"token_id:9": -3.0, "token_id:1": -0.1, "token_id:2": -0.9},
                                            {"token_id:4": -0.2, "token_id:8": -1.7}]}}  # fmt: skip
    assert choice_top(choice, 2) == [[(-0.1, 1), (-0.9, 2)], [(-0.2, 4), (-1.7, 8)]]


def test_prompt_logprobs_in_sglangs_layout():
    """vLLM's `prompt_logprobs` (None, then {id: {logprob, rank}} holding the prompt token and the top k) become
    SGLang's input logprobs from `logprob_start_len` on: the first scored position None, whatever the start."""
    params = SamplingParams(max_new_tokens=0)
    item = WorkItem("r", [5, 6, 7, 8], params, 0, True, 2, 1)
    body = completion_body(item, "p", stream=False)
    assert body["prompt_logprobs"] == 2 and body["max_tokens"] == 1  # vLLM refuses 0: the token is dropped
    choice = {"prompt_logprobs": [
        None,
        {"6": {"logprob": -1.0, "rank": 1}},
        {"7": {"logprob": -3.0, "rank": 4}, "1": {"logprob": -0.5, "rank": 1}, "2": {"logprob": -0.7, "rank": 2}},
        {"8": {"logprob": -0.2, "rank": 1}, "3": {"logprob": -2.0, "rank": 2}},
    ]}  # fmt: skip
    scored = prompt_scores(choice, item)
    assert scored.logprobs == [None, -3.0, -0.2]
    assert scored.top == [None, [(-0.5, 1), (-0.7, 2)], [(-0.2, 8), (-2.0, 3)]]
    assert prompt_scores(choice, WorkItem("r", [5, 6, 7, 8], params, 0, True, 0, 4)).logprobs == []
    assert "prompt_logprobs" not in completion_body(WorkItem("r", [5], params, 3, True), "p", stream=False)
    with pytest.raises(ValueError, match="none"):
        prompt_scores({}, item)
