"""Trainer throughput: packed micro-batches (arl's path) versus padded batches, same samples, same model.

Data: sample lengths drawn from a lognormal (long-tailed, like agent trajectories: most short, a few
very long), each with a 30 % prompt, random token ids, behaviour log-probs and rewards in GRPO groups.

* packed: `pipeline.trainer.packing.plan_step` rows of <= `--budget` tokens, batch size 1, position ids
  restarting per sample, trained by the real `TorchBackend.train_minibatch` (forward, policy loss,
  backward, grad clip, AdamW step).
* padded: the same samples in the same random order, in batches holding on average as many real
  tokens as a packed row (batch size = budget / mean length), right-padded to the longest sample of
  the batch with an attention mask; same model, same loss, same optimizer step.

Both run one optimizer update over all samples; tokens/s counts real (unpadded) tokens only. On GPU
it trains in bf16 autocast and reports MFU = 6 * params * tokens / time / peak bf16 FLOP/s.

Usage: `python benchmarks/train_throughput.py [--samples 64] [--budget 2048] [--gpu-model]`.
`--gpu-model` uses a ~0.5B Qwen2-architecture config (Qwen2.5-0.5B shapes, random init). Prints a
table, then one `RESULT {...}` JSON line for `arl bench`. Target: packed >= 1.5x padded.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SMALL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 4096}  # fmt: skip
QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936}  # fmt: skip


def make_model(out: Path, shape: dict[str, Any], max_len: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=max(max_len, 4096), tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(out))


def make_samples(n: int, vocab: int, median: int, sigma: float, max_len: int, seed: int = 0) -> list[Any]:
    from pipeline.trainer.data import rows_to_samples

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), sigma, size=n).astype(int), 16, max_len)
    rows = []
    for i, length in enumerate(lengths):
        prompt = max(1, int(length * 0.3))
        mask = [0] * prompt + [1] * (length - prompt)
        rows.append({"sample_id": str(i), "group_id": str(i // 8), "input_ids": rng.integers(0, vocab, length).tolist(),
                     "loss_mask": mask, "logprobs": [-1.5 * m for m in mask],
                     "versions": [0 if m else -1 for m in mask], "reward": float(rng.integers(0, 2))})  # fmt: skip
    return rows_to_samples(rows)


def padded_update(backend: Any, samples: list[Any], advantages: np.ndarray, batch_size: int, loss_fn: Any) -> int:
    """One optimizer update over padded batches (the baseline); returns the padded token count."""
    import torch

    from pipeline.trainer.losses import TokenBatch, gather_logprobs
    from pipeline.trainer.packing import build_micro_batch, sample_weights

    members = list(range(len(samples)))
    weights = dict(zip(members, sample_weights(samples, members, "token").tolist(), strict=True))
    model, device = backend.model, backend.device
    backend.optimizer.zero_grad(set_to_none=True)
    padded_tokens = 0
    for start in range(0, len(samples), batch_size):
        rows = [build_micro_batch(samples, [i], advantages, weights) for i in members[start : start + batch_size]]
        width = max(r.num_tokens for r in rows)
        padded_tokens += width * len(rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attn = torch.zeros(len(rows), width, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : r.num_tokens] = r.input_ids[0]
            attn[j, : r.num_tokens] = 1
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if backend.autocast else _null()
        with ctx:
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
        total = torch.zeros((), device=device)
        for j, r in enumerate(rows):  # the loss on each row's real tokens, exactly as in the packed path
            logp = gather_logprobs(logits[j, : r.num_tokens], r.targets.to(device))
            t = r.tokens
            batch = TokenBatch(t.mask.to(device), t.weights.to(device), t.advantages.to(device),
                               t.behav_logp.to(device))  # fmt: skip
            total = total + loss_fn(logp, None, batch).loss
        total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    backend.optimizer.step()
    return padded_tokens


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pipeline.run.config import load_config
    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.losses import policy_loss
    from pipeline.trainer.metrics import peak_flops
    from pipeline.trainer.packing import plan_step
    from pipeline.trainer.torch_backend import TorchBackend

    shape = QWEN_05B if args.gpu_model else SMALL
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), shape, args.max_len)
        config = load_config(None, [f"model.path={tmp}", f"trainer.micro_batch_tokens={args.budget}",
                                    "trainer.algorithm.decoupled=false"])  # fmt: skip
        backend = TorchBackend(config, total_updates=100)
        backend.load(Path(tmp), None)
    samples = make_samples(args.samples, shape["vocab_size"], args.median, args.sigma, args.max_len)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples], "grpo")
    real = sum(len(s.input_ids) for s in samples)
    batch_size = max(1, round(args.budget / (real / len(samples))))

    def loss_fn(logp: Any, entropy: Any, batch: Any) -> Any:
        return policy_loss(logp, entropy, batch, config.trainer.algorithm)

    def packed() -> None:
        plan = plan_step(samples, adv, minibatches=1, budget=args.budget, agg="token", seed=0, step=0)
        backend.train_minibatch(plan[0], loss_fn)

    timings: dict[str, list[float]] = {"packed": [], "padded": []}
    padded_tokens = 0
    for rep in range(args.repeats + 1):  # the first round warms up (allocator, kernels) and is not counted
        for name in ("packed", "padded"):
            _sync(backend.device)
            t0 = time.perf_counter()
            if name == "packed":
                packed()
            else:
                padded_tokens = padded_update(backend, samples, adv, batch_size, loss_fn)
            _sync(backend.device)
            if rep > 0:
                timings[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in timings.items()}
    rows = len(plan_step(samples, adv, minibatches=1, budget=args.budget, agg="token", seed=0, step=0)[0])
    figures: dict[str, Any] = {
        "device": str(backend.device) + (f" ({torch.cuda.get_device_name()})" if backend.device.type == "cuda" else ""),
        "params_M": round(backend.num_params / 1e6, 1),
        "samples": len(samples),
        "real_tokens": real,
        "max_len": max(len(s.input_ids) for s in samples),
        "budget": args.budget,
        "packed_rows": rows,
        "padded_batch_size": batch_size,
        "padding_frac": round(1 - real / padded_tokens, 3),
        "packed_tok_s": round(real / best["packed"], 1),
        "padded_tok_s": round(real / best["padded"], 1),
    }
    peak = peak_flops(backend.device)
    if peak:
        figures["packed_mfu"] = round(6 * backend.num_params * real / best["packed"] / peak, 4)
        figures["padded_mfu"] = round(6 * backend.num_params * real / best["padded"] / peak, 4)
    ratio = best["padded"] / best["packed"]
    return {"name": "train_throughput", "figures": figures, "ratios": {"packed_vs_padded": round(ratio, 2)},
            "reference": "padded batches of the same samples (same real tokens per micro-batch on average)",
            "targets": {"packed_vs_padded >= 1.5": "met" if ratio >= 1.5 else f"missed ({ratio:.2f})"}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048, help="tokens per packed row (micro_batch_tokens)")
    parser.add_argument("--median", type=int, default=160, help="median sample length (lognormal)")
    parser.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma (tail weight)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-model", action="store_true", help="~0.5B Qwen2 shapes (for a GPU)")
    result = run(parser.parse_args())
    for key, value in {**result["figures"], **result["ratios"]}.items():
        print(f"{key:>20}: {value}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
