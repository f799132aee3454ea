"""Concat and individual exports of the same 8-turn sessions train on the same log-probabilities.

Real parts on loopback: the tiny model served by a real `hf` engine, the real proxy, an 8-turn
tool-using agent on the plain OpenAI SDK (`benchmarks/_multiturn_sessions.py`), and the trainer's
own path (shard write and load, packing, `TorchBackend.logprobs`). The harness is
`benchmarks/concat_tokens.py`, imported as a module: the same code the benchmark runs. Timing is the
benchmark's business, never asserted here.
"""

from __future__ import annotations

from pathlib import Path

TURNS = 8


async def test_both_styles_give_every_sampled_token_the_same_logprob(tiny_model_dir: Path, tmp_path: Path) -> None:
    from benchmarks import concat_tokens as harness

    sessions = await harness.collect_sessions(tiny_model_dir, sessions=2, turns=TURNS, max_tokens=8, group_size=2)
    for s in sessions:
        assert s.num_interactions == TURNS and s.prefix_breaks == 0
        assert [row.num_turns for row in s.concat] == [TURNS] and len(s.individual) == TURNS

    sampled = sum(sum(row.loss_mask) for s in sessions for row in s.concat)
    for packing in ("padded", "packed"):  # the trainer's layouts: CPU/sdpa pads, flash-attention packs
        agreement, backend, _, _ = harness.logprob_agreement(sessions, tiny_model_dir, tmp_path, packing=packing)
        backend.close()
        assert agreement["sampled_tokens_compared"] == sampled > 0  # every sampled token, matched across styles
        assert agreement["max_abs_dlogp_concat_vs_individual"] <= 1e-4, packing
        assert agreement["max_abs_dlogp_concat_vs_engine"] <= 1e-3, packing  # the engine: KV cache, batches

    concat, individual = (harness.total_tokens(sessions, style) for style in ("concat", "individual"))
    assert concat * 4 <= individual  # 8 turns: the row of a run holds its prefix once instead of 8 times
