"""Synthetic trajectory rows with real behaviour log-probs, for trainer tests and benchmarks.

Each group shares a prompt; half its completions are "good" (rewarded 1) and half "bad" (0), so
GRPO has a signal to learn. Behaviour log-probs come from a teacher-forced forward pass of a real
model (what an engine of that version would have recorded), so importance weights start near 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def synthetic_rows(
    step: int,
    *,
    num_groups: int = 2,
    group_size: int = 4,
    prompt_len: int = 8,
    completion_lens: Sequence[int] | None = None,
    vocab_size: int = 480,
    version: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows of every shard column (behaviour log-probs zero: fill them with `add_behaviour_logprobs`).

    `completion_lens` gives each row's completion length (cycled); default 6. Even-indexed members
    of a group repeat the "good" pattern and are rewarded 1.0; odd ones the "bad" pattern, 0.0.
    """
    rng = np.random.default_rng(seed * 7919 + step)
    lens = list(completion_lens or [6])
    rows, k = [], 0
    for g in range(num_groups):
        prompt = rng.integers(3, vocab_size, size=prompt_len).tolist()
        good = rng.integers(3, vocab_size, size=max(lens)).tolist()
        bad = rng.integers(3, vocab_size, size=max(lens)).tolist()
        for j in range(group_size):
            n = lens[k % len(lens)]
            k += 1
            completion = (good if j % 2 == 0 else bad)[:n]
            rows.append(
                _row(step, g, j, prompt, completion, 1.0 if j % 2 == 0 else 0.0, step if version is None else version)
            )
    return rows


def _row(step: int, g: int, j: int, prompt: list[int], completion: list[int], reward: float, version: int) -> dict:
    n_p, n_c = len(prompt), len(completion)
    return {
        "step": step,
        "session_id": f"s{step}-{g}-{j}",
        "sample_id": f"x{step}-{g}-{j}",
        "parent_id": None,
        "group_id": f"g{step}-{g}",
        "input_ids": prompt + completion,
        "loss_mask": [0] * n_p + [1] * n_c,
        "logprobs": [0.0] * (n_p + n_c),
        "versions": [-1] * n_p + [version] * n_c,
        "reward": reward,
        "prompt_len": n_p,
        "num_turns": 1,
        "finish_reason": "stop",
        "created_at": 1_700_000_000_000,
        "metadata": json.dumps({"synthetic": True}),
    }


def add_behaviour_logprobs(rows: list[dict[str, Any]], model_dir: str | Path) -> list[dict[str, Any]]:
    """Fill `logprobs` on sampled tokens with the teacher-forced log-probs of the model in `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
            token_lp = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            row["logprobs"] = [0.0] + [lp if m else 0.0 for lp, m in zip(token_lp, row["loss_mask"][1:], strict=True)]
    return rows
