"""A short supervised warm start of a tiny model on a chat corpus (the demo's format-only phase).

A random-init tiny model almost never writes "two digits, then stop", so RL on the demo's task
would first have to discover the answer format from a reward that is nearly always zero. The warm
start teaches that format and nothing else: its corpus (examples/data/demo_format.jsonl) has
prompts that never mention a number or ask to repeat anything ("Pick a number.") and replies that
are random two-digit numbers, so no reply can be predicted from its prompt. Copying the number a
prompt names is left entirely to RL; `arl demo` measures the exact-correct rate before RL (its
step 0) and after.

Corpus rows: `{"messages": [{"role": ..., "content": ...}, ...], "reply": "47"}`. Each row is
rendered with the model's chat template (generation prompt included, exactly as the proxy renders an
agent's request), the reply's tokens and the end-of-turn token are appended, and only those are
trained (a plain next-token cross-entropy, mean over trained tokens). The model directory is
updated in place through a sibling temp directory, and `warm_start.json` in it records what was
done, so a warm-started model says so.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from pipeline.run.handoff import write_json_atomic

RECORD = "warm_start.json"
"""File in the model directory that records the warm start (corpus, steps, lr, losses)."""


@dataclass(frozen=True)
class WarmStartResult:
    corpus: str
    """The corpus file (absolute path)."""
    rows: int
    steps: int
    batch_size: int
    lr: float
    seed: int
    first_loss: float
    """Mean loss of the first batch (before any update)."""
    last_loss: float
    """Mean loss of the last batch."""


Row = tuple[list[dict[str, Any]], str | None, list[dict[str, Any]] | None]
"""A corpus row: (messages, reply or None, tools or None)."""


def load_corpus(path: Path) -> list[Row]:
    """The corpus's rows; errors name the file and line. A row either has a `reply` (trained after `messages`) or
    none, and then its assistant messages (tool calls included) are what is trained; `tools` is optional."""
    from pipeline.agents.dataset import numbered_jsonl

    rows: list[Row] = []
    for number, row in numbered_jsonl(Path(path)):
        messages, reply, tools = row.get("messages"), row.get("reply"), row.get("tools")
        has_turns = isinstance(messages, list) and any(m.get("role") == "assistant" for m in messages)
        good_reply = (isinstance(reply, str) and reply) or (reply is None and has_turns)
        if not isinstance(messages, list) or not messages or not good_reply or not isinstance(tools, list | None):
            raise ArlError(
                f"{path}:{number}: a warm-start row needs 'messages' (a non-empty list of chat messages) and "
                f"either 'reply' (a non-empty string) or assistant messages to train, and 'tools' (if any) must "
                f"be a list; got keys {sorted(row)}"
            )
        rows.append((messages, reply, tools))
    if not rows:
        raise ArlError(f"warm-start corpus {path} has no rows")
    return rows


def encode_row(
    tokenizer: Any, messages: list[dict[str, Any]], reply: str | None, tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask of the trained ones. With a `reply`: the prompt (with
    its generation prompt, exactly as the proxy renders an agent's request) + the reply + end of turn, the last two
    trained. Without: the whole conversation, each assistant turn's tokens trained from its generation prompt up to
    and including its end-of-turn token: exactly what the model samples for that turn."""
    if reply is not None:
        prompt = _render(tokenizer, messages, tools, generation_prompt=True)
        answer = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    ids = _render(tokenizer, messages, tools, generation_prompt=False)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, messages[:index], tools, generation_prompt=True))
        end = ids.index(tokenizer.eos_token_id, start) + 1 if tokenizer.eos_token_id in ids[start:] else len(ids)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation_prompt: bool
) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def warm_start(
    model_dir: str | Path,
    corpus: str | Path,
    *,
    steps: int = 120,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
) -> WarmStartResult:
    """Train `model_dir` in place for `steps` AdamW steps on batches drawn (seeded) from `corpus`.
    The same arguments give the same weights. The defaults are the demo's: at lr 3e-3 the tiny model's
    loss still spikes after 50 steps, and the result then depends on the CPU's thread count; at 1e-3 it
    settles (two-digit replies ~92% of the time after 120 steps) and does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, corpus = Path(model_dir).resolve(), Path(corpus).resolve()
    if steps < 1 or batch_size < 1:
        raise ArlError(f"warm start needs steps >= 1 and batch_size >= 1, got {steps} and {batch_size}")
    rows = load_corpus(corpus)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = [encode_row(tokenizer, messages, reply, tools) for messages, reply, tools in rows]
    rng = random.Random(seed)
    losses = []
    # fork_rng: a seeded run that leaves the caller's global RNG stream as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            ids, mask = _batch(
                [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)], tokenizer.pad_token_id
            )
            loss = _loss(model, ids, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    result = WarmStartResult(
        corpus=str(corpus),
        rows=len(rows),
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        first_loss=losses[0],
        last_loss=losses[-1],
    )
    _save_in_place(model, model_dir, result)
    return result


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    return ids, mask


def _loss(model: Any, ids: Any, mask: Any) -> Any:
    from pipeline.trainer.losses import gather_logprobs

    # Right padding and a causal model: the padded tail never influences the trained positions.
    logp = gather_logprobs(model(ids).logits[:, :-1], ids[:, 1:])
    target = mask[:, 1:]
    return -(logp * target).sum() / target.sum()


def _save_in_place(model: Any, model_dir: Path, result: WarmStartResult) -> None:
    """Write the new weights beside the model dir, then swap the weight file in and add the record; a reader
    never sees half-written weights (config, tokenizer and generation config are unchanged)."""
    tmp = model_dir.parent / f".{model_dir.name}.warm-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))
        for name in os.listdir(tmp):
            if name.endswith(".safetensors"):
                os.replace(tmp / name, model_dir / name)
        # the record is what says the warm start is complete (`pipeline.demo.demo_run.ensure_tiny_model`): never torn
        write_json_atomic(model_dir / RECORD, asdict(result))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_record(model_dir: str | Path) -> WarmStartResult | None:
    """The warm start recorded in `model_dir`, or None for a model that had none."""
    path = Path(model_dir) / RECORD
    if not path.exists():
        return None
    return WarmStartResult(**json.loads(path.read_text(encoding="utf-8")))
