"""Request expansion/validation, response shapes and client-side wire parsing of the SGLang protocol."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.client.wire import (
    EngineError,
    StreamState,
    chunk_from,
    parse_finish_reason,
    parse_weight_version,
    result_from,
)
from pipeline.engine.server.hf.kvbatch import KVBatch
from pipeline.engine.server.requests import (
    Limits,
    Produced,
    RequestError,
    expand,
    finish_text,
    response,
    splice_top,
    stop_token_ids,
)
from schemas.engine_api import GenerateReqInput, InitWeightsUpdateGroupReqInput, SamplingParams

LIMITS = Limits(vocab_size=100, max_context=32)


def items(**body):  # type: ignore[no-untyped-def]
    return expand(GenerateReqInput.model_validate(body), LIMITS, tokenizer=None)


def test_single_prompt_defaults_like_sglang():
    (item,) = items(input_ids=[1, 2, 3], rid="r")
    assert item.rid == "r" and item.input_ids == [1, 2, 3] and item.return_logprob is False
    assert item.params.max_new_tokens == 128 and item.params.temperature == 1.0
    assert item.max_new_tokens == 32 - 3  # clipped to the context, not refused


def test_batch_with_per_prompt_params_and_n_is_prompt_major():
    out = items(
        input_ids=[[1], [2, 3]],
        rid=["a", "b"],
        sampling_params=[{"n": 2}, {"max_new_tokens": 4}],
        return_logprob=[True, False],
    )
    assert [(i.rid, i.input_ids, i.return_logprob) for i in out] == [
        ("a_0", [1], True),
        ("a_1", [1], True),
        ("b", [2, 3], False),
    ]
    assert out[2].max_new_tokens == 4


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 100]}, "outside the vocabulary"),
        ({"input_ids": [1] * 32}, "context holds 32"),
        ({"input_ids": [[1], []]}, "prompt 1 is empty"),
        ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, "distinct"),
        ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob has 1 entries"),
        ({"input_ids": [1], "sampling_params": {"top_k": -5}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"input_ids": [1], "stream": True, "sampling_params": {"n": 2}}, "stream=true"),
    ],
)
def test_refusals_name_the_problem(body, needle):  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError, match=needle):
        items(**body)


def test_model_level_refusals():
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        GenerateReqInput.model_validate({"sampling_params": {}})
    with pytest.raises(ValueError, match="logprob_start_len"):
        GenerateReqInput.model_validate({"input_ids": [1], "logprob_start_len": -2})
    with pytest.raises(ValueError, match="rank_offset"):
        InitWeightsUpdateGroupReqInput(master_address="h", master_port=1, rank_offset=2, world_size=2)


def test_stop_tokens_and_ignore_eos():
    assert stop_token_ids(SamplingParams(stop_token_ids=[7]), {2}) == {2, 7}
    assert stop_token_ids(SamplingParams(stop_token_ids=[7], ignore_eos=True), {2}) == set()


def test_stop_string_trimming():
    finish = {"type": "stop", "matched": "END"}
    assert finish_text("hello END tail", finish, SamplingParams()) == "hello "
    assert finish_text("hello END", finish, SamplingParams(no_stop_trim=True)) == "hello END"
    assert finish_text("hello", {"type": "length", "length": 3}, SamplingParams()) == "hello"


def test_weight_versions_and_finish_reasons_from_sglang():
    assert parse_weight_version("7") == 7 and parse_weight_version("default") == 0 and parse_weight_version(3) == 3
    with pytest.raises(EngineError, match="weight-version"):
        parse_weight_version("v1")
    assert parse_finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == ("stop", 2)
    assert parse_finish_reason({"finish_reason": {"type": "length", "length": 9}}) == ("length", None)
    assert parse_finish_reason({"finish_reason": None}) == (None, None)


def _payload(ids, lps, finish=None, version="1"):  # type: ignore[no-untyped-def]
    return {
        "output_ids": ids,
        "meta_info": {
            "completion_tokens": len(ids) if finish != "delta" else 99,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            "finish_reason": None,
            "weight_version": version,
        },
    }


def test_cumulative_chunks_become_increments():
    state = StreamState()
    first = chunk_from(_payload([5], [-0.5]), state)
    second = chunk_from(_payload([5, 6, 7], [-0.5, -0.6, -0.7]), state)
    assert first is not None and second is not None
    assert (first.new_ids, second.new_ids) == ([5], [6, 7])
    assert second.new_logprobs == [-0.6, -0.7] and second.weight_version == 1


def test_incremental_chunks_pass_through():
    state = StreamState()
    for ids, total in (([5], 1), ([5], 2), ([6, 7], 4)):  # a delta that repeats the previous token stays a delta
        payload = _payload(ids, [-0.1] * len(ids))
        payload["meta_info"]["completion_tokens"] = total
        chunk = chunk_from(payload, state)
        assert chunk is not None and chunk.new_ids == ids
    assert state.ids == [5, 5, 6, 7]


def test_kv_batch_merge_select_and_trim():
    def batch(lengths: list[int], width: int) -> KVBatch:
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, width - length :] = 1
        kv = [(torch.randn(len(lengths), 2, width, 4), torch.randn(len(lengths), 2, width, 4))]
        return KVBatch(kv, mask)

    a, b = batch([3, 5], 5), batch([2], 2)
    merged = a.merge(b)
    assert merged.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert torch.equal(merged.kv[0][0][2, :, 3:], b.kv[0][0][0])  # b's keys, right-aligned
    kept = merged.select([0, 2])
    assert kept is not None and kept.mask.tolist() == [[1, 1, 1], [0, 1, 1]]  # padding-only columns trimmed
    assert kept.lengths().tolist() == [[3], [2]]
    assert merged.select([]) is None


def test_top_logprobs_num_is_per_prompt_bounded_and_needs_return_logprob():
    out = items(input_ids=[[1], [2]], return_logprob=True, top_logprobs_num=[3, 0], sampling_params=[{"n": 2}, {}])
    assert [i.top_logprobs_num for i in out] == [3, 3, 0]
    with pytest.raises(RequestError, match="needs return_logprob"):
        items(input_ids=[1], top_logprobs_num=2)
    with pytest.raises(RequestError, match="for prompt 1 needs return_logprob"):
        items(input_ids=[[1], [2]], return_logprob=[True, False], top_logprobs_num=2)
    for bad in (21, -1, [0, 50]):
        with pytest.raises(ValueError, match="top_logprobs_num must be between 0 and 20"):
            GenerateReqInput.model_validate({"input_ids": [1], "return_logprob": True, "top_logprobs_num": bad})


def test_response_carries_output_top_logprobs_only_when_asked():
    class Tok:
        def decode(self, ids, **_):  # type: ignore[no-untyped-def]
            return "".join(f"<{i}>" for i in ids)

    (plain,) = items(input_ids=[1], return_logprob=True)
    (asked,) = items(input_ids=[1], return_logprob=True, top_logprobs_num=2)
    top = [[(-0.1, 7), (-2.5, 9)], [(-0.3, 8), (-1.4, 7)]]
    assert "output_top_logprobs" not in response(plain, Produced([7, 8], [-0.1, -0.3], None, 0), Tok())["meta_info"]
    produced = Produced([7, 8], [-0.1, -0.3], None, 0, top_logprobs=top)
    meta = response(asked, produced, Tok(), text_in_logprobs=True)["meta_info"]
    assert meta["output_top_logprobs"] == [[[-0.1, 7, "<7>"], [-2.5, 9, "<9>"]], [[-0.3, 8, "<8>"], [-1.4, 7, "<7>"]]]


def test_top_logprobs_on_the_wire_cumulative_incremental_and_checked():
    def payload(ids, tops, total):  # type: ignore[no-untyped-def]
        return {"output_ids": ids, "meta_info": {"completion_tokens": total, "finish_reason": None,
                "output_token_logprobs": [[-1.0, t, None] for t in ids],
                "output_top_logprobs": [[[lp, t, None] for lp, t in top] for top in tops]}}  # fmt: skip

    a, b = [(-0.5, 5), (-1.0, 3)], [(-0.2, 6), (-2.0, 5)]
    state = StreamState(top_logprobs_num=2)
    chunk_from(payload([5], [a], 1), state)
    second = chunk_from(payload([5, 6], [a, b], 2), state)  # cumulative, as SGLang streams by default
    assert second is not None and second.new_top_logprobs == [b] and state.top == [a, b]
    state = StreamState(top_logprobs_num=2)
    chunk_from(payload([5], [a], 1), state)
    chunk_from(payload([6], [b], 2), state)  # --incremental-streaming-output deltas
    assert state.top == [a, b]
    assert chunk_from(payload([5], [a], 1), StreamState()).new_top_logprobs is None  # type: ignore[union-attr]
    assert result_from(payload([5, 6], [a, b], 2), "u", 2).output_top_logprobs == [a, b]
    assert result_from(payload([5, 6], [a, b], 2), "u").output_top_logprobs is None
    with pytest.raises(EngineError, match="does the server support top_logprobs_num"):
        result_from(payload([5, 6], [], 2), "u", 2)


def test_splice_top_adds_pre_encoded_positions_to_a_response():
    import json

    body = json.dumps({"text": "}}", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": None}})
    position = [[-0.5, 5, None], [-1.5, 3, "x"]]
    spliced = json.loads(splice_top(body, [json.dumps(position)]))
    assert spliced["meta_info"] == {"id": "r", "finish_reason": None, "output_top_logprobs": [position]}
    assert spliced["text"] == "}}"
    with pytest.raises(ValueError, match="meta_info last"):
        splice_top(json.dumps({"meta_info": {}, "text": "x"}), [])
