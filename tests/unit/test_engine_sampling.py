"""Next-token sampling semantics (SGLang's): which tokens may be drawn, and which logprob is reported."""

from __future__ import annotations

import torch

from pipeline.engine.server.hf.sampling import RowSampling, sample_batch, sample_next


def logits_batch(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_with_the_unscaled_logprob():
    logits = logits_batch()
    tokens, logprobs = sample_next(logits, [RowSampling(temperature=0.0)] * 4)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-6)


def test_sampled_rows_report_the_temperature_scaled_logprob_by_default():
    logits = logits_batch()
    rows = [RowSampling(temperature=t) for t in (0.5, 1.0, 2.0, 3.0)]
    tokens, logprobs = sample_next(logits, rows, generator=torch.Generator().manual_seed(1))
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        scaled = torch.log_softmax(logits[i] / rows[i].temperature, -1)[token].item()
        assert abs(logprob - scaled) < 1e-5


def test_original_logprob_mode_reports_unscaled():
    logits = logits_batch()
    rows = [RowSampling(temperature=2.0)] * 4
    tokens, logprobs = sample_next(
        logits, rows, generator=torch.Generator().manual_seed(1), return_original_logprob=True
    )
    raw = torch.log_softmax(logits, -1)
    assert all(abs(lp - raw[i, t].item()) < 1e-5 for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)))


def test_top_k_one_and_tiny_top_p_always_pick_the_most_likely_token():
    logits = logits_batch(rows=2)
    for rows in ([RowSampling(top_k=1)] * 2, [RowSampling(top_p=1e-6)] * 2, [RowSampling(min_p=1.0)] * 2):
        for seed in range(20):
            tokens, _ = sample_next(logits, rows, generator=torch.Generator().manual_seed(seed))
            assert tokens == logits.argmax(-1).tolist()


def test_top_k_restricts_draws_to_the_k_most_likely():
    logits = logits_batch(rows=1, vocab=30)
    allowed = set(logits[0].topk(3).indices.tolist())
    seen = set()
    for seed in range(200):
        tokens, logprobs = sample_next(
            logits, [RowSampling(temperature=5.0, top_k=3)], generator=torch.Generator().manual_seed(seed)
        )
        seen.add(tokens[0])
        # the logprob is still of the full (scaled) distribution, before truncation
        assert abs(logprobs[0] - torch.log_softmax(logits[0] / 5.0, -1)[tokens[0]].item()) < 1e-5
    assert seen == allowed


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        sample_next(logits, [RowSampling(top_p=0.7)], generator=torch.Generator().manual_seed(s))[0][0]
        for s in range(200)
    }
    assert seen == {0, 1}  # mass before token 2 is 0.8 > 0.7


def test_per_request_generator_makes_a_row_reproducible_whatever_its_neighbours():
    logits = logits_batch(rows=3)

    def draw(seed_other: int) -> int:
        rows = [RowSampling(), RowSampling(generator=torch.Generator().manual_seed(42)), RowSampling()]
        return sample_next(logits, rows, generator=torch.Generator().manual_seed(seed_other))[0][1]

    assert len({draw(s) for s in range(10)}) == 1


def test_mixed_greedy_and_sampled_rows():
    logits = logits_batch()
    rows = [RowSampling(temperature=0.0), RowSampling(temperature=1.0), RowSampling(temperature=0.0), RowSampling()]
    tokens, logprobs = sample_next(logits, rows, generator=torch.Generator().manual_seed(3))
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()
    assert all(lp <= 0 for lp in logprobs)


def test_top_logprobs_come_from_the_distribution_of_the_returned_logprob():
    logits = logits_batch(rows=4, vocab=60)
    rows = [RowSampling(temperature=0.0, top_logprobs_num=5), RowSampling(temperature=2.0, top_logprobs_num=3),
            RowSampling(temperature=0.5), RowSampling(temperature=1.5, top_logprobs_num=20)]  # fmt: skip
    out = sample_batch(logits, rows, generator=torch.Generator().manual_seed(2))
    assert out.top[2] is None  # a row that asks for none gets none
    for i in (0, 1, 3):
        dist = torch.log_softmax(logits[i] / (rows[i].temperature if not rows[i].greedy else 1.0), -1)
        want = dist.topk(rows[i].top_logprobs_num)
        top = out.top[i]
        assert top is not None and [t for _, t in top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for v, _ in top]), want.values, atol=1e-6)
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
        if out.tokens[i] in want.indices.tolist():  # the sampled token's entry is its returned logprob
            assert abs(dict((t, v) for v, t in top)[out.tokens[i]] - out.logprobs[i]) < 1e-6
    assert out.top[0][0][1] == out.tokens[0]  # greedy: the most likely alternative is the token itself


def test_top_logprobs_follow_the_original_logprob_opt_in():
    logits = logits_batch(rows=2)
    rows = [RowSampling(temperature=3.0, top_logprobs_num=4)] * 2
    out = sample_batch(logits, rows, generator=torch.Generator().manual_seed(1), return_original_logprob=True)
    raw = torch.log_softmax(logits, -1).topk(4)
    for i in range(2):
        assert [t for _, t in out.top[i]] == raw.indices[i].tolist()  # type: ignore[union-attr]
        assert torch.allclose(torch.tensor([v for v, _ in out.top[i]]), raw.values[i], atol=1e-6)  # type: ignore[union-attr]


def test_top_logprobs_num_above_the_vocabulary_returns_the_whole_vocabulary():
    logits = logits_batch(rows=1, vocab=6)
    out = sample_batch(logits, [RowSampling(temperature=0.0, top_logprobs_num=20)])
    assert out.top[0] is not None and sorted(t for _, t in out.top[0]) == list(range(6))


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    rows = 20000
    out = sample_batch(
        torch.log(probs).repeat(rows, 1), [RowSampling()] * rows, generator=torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(torch.tensor(out.tokens), minlength=5).double() / rows
    assert freq[1] == 0
    assert torch.allclose(freq, probs.double(), atol=0.015), freq.tolist()
    truncated = sample_batch(torch.log(probs).repeat(rows, 1), [RowSampling(top_k=2)] * rows,
                             generator=torch.Generator().manual_seed(1))  # fmt: skip
    freq = torch.bincount(torch.tensor(truncated.tokens), minlength=5).double() / rows
    assert torch.allclose(freq, torch.tensor([2 / 3, 0, 0, 1 / 3, 0], dtype=torch.float64), atol=0.015), freq.tolist()
