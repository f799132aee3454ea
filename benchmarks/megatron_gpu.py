"""Megatron backend on one GPU: bf16 equivalence with the torch backend, then throughput and MFU.

Run on 2026-11-25 on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, megatron-core 0.16.1); figures in
docs/megatron.md ("GPU checks") and benchmarks/RESULTS.md. Equivalence passed; the MFU target was missed
(megatron 6.6% at ~0.5B, 16.9% at ~1.5B). GPU only: `arl bench` skips it. megatron-core and pydantic are
not on the GPU image; carry their wheels:
    pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 -d wheels/
    # plus pydantic, pydantic-core, annotated-types, typing-inspection; on the device:
    pip install --no-deps --target /tmp/site wheels/*.whl && PYTHONPATH=/tmp/site:. python benchmarks/megatron_gpu.py

1. Equivalence (bf16). A small random Qwen2 (hidden 512, 4 layers, GQA 8/2, vocab 32k) and one packed
   row set. References: the torch backend in fp32 (no autocast) = ground truth; the torch backend in
   bf16 autocast = what the project already accepts. Tolerances are *relative to HF's own bf16 error*:
   bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per op), so no fixed absolute bound is
   meaningful across models; instead megatron-bf16 must be no further from fp32 than 2x HF-bf16 is
   (+1e-3 slack for the tiniest errors), for per-token log-probs (mean and max abs error), the loss,
   the grad norm, and every gradient (1 - cosine similarity to the fp32 gradient).
2. Throughput. A ~0.5B (Qwen2.5-0.5B shapes, default) or ~1.5B (`--model 1.5b`) random Qwen2, packed
   rows of `--seq` (4096) tokens made of samples with lognormal lengths, `--rows` rows per optimizer
   update; each backend's real `train_minibatch` (forward, shared policy loss, backward, clip, optimizer
   step), `--warmup` untimed updates then `--updates` timed ones, in the same process.
   tokens/s counts every token; MFU = 6 * N * tokens / s / peak bf16 FLOP/s (the loop's own formula,
   which ignores attention) and MFU_attn adds causal attention's 6 * layers * hidden * L per token for a
   sample of length L. Target: megatron MFU >= 40% on one H100 (docs/megatron.md).

Prints tables, then one `RESULT {...}` JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SMALL: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip
MODELS: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936},
}  # fmt: skip


def make_model(out: Path, shape: dict[str, Any], seq: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=max(seq, 4096), tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    return out


def make_rows(vocab: int, seq: int, rows: int, median: int, seed: int = 0) -> list[dict[str, Any]]:
    """Samples with lognormal lengths, exactly filling `rows` rows of `seq` tokens when packed."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for r in range(rows):
        room = seq
        while room > 0:
            n = int(min(room, max(32, rng.lognormal(np.log(median), 0.6))))
            if room - n < 32:
                n = room
            prompt = max(1, int(n * 0.3))
            mask = [0] * prompt + [1] * (n - prompt)
            out.append({"sample_id": f"{r}-{len(out)}", "group_id": str(len(out) // 4),
                        "input_ids": rng.integers(0, vocab, n).tolist(), "loss_mask": mask,
                        "logprobs": [-1.5 * m for m in mask], "versions": [0 if m else -1 for m in mask],
                        "reward": float(rng.integers(0, 2))})  # fmt: skip
            room -= n
    return out


def make_config(model_dir: Path, root: Path, backend: str, bf16: bool, seq: int) -> Any:
    from pipeline.run.config import load_config

    return load_config(None, [f"fileroot={root}", "experiment_name=bench", "trial_name=megatron",
                              f"model.path={model_dir}", "model.dtype=bfloat16", "trainer.device=cuda",
                              f"trainer.backend={backend}", f"trainer.bf16={str(bf16).lower()}",
                              f"trainer.micro_batch_tokens={seq}"])  # fmt: skip


def make_plan(rows: list[dict[str, Any]], config: Any, seq: int) -> list[Any]:
    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.data import rows_to_samples
    from pipeline.trainer.packing import plan_step

    samples = rows_to_samples(rows)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples],
                             config.trainer.algorithm.advantage)  # fmt: skip
    return plan_step(samples, adv, minibatches=1, budget=seq, agg="token", seed=0, step=0)[0]


def loss_fn_for(config: Any) -> Any:
    from pipeline.trainer.losses import policy_loss

    algo = config.trainer.algorithm

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor | None, batch: Any) -> Any:
        return policy_loss(logp, entropy, dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask), algo)

    return loss_fn


def open_backend(config: Any, model_dir: Path) -> Any:
    if config.trainer.backend == "megatron":
        from pipeline.trainer.megatron.megatron_backend import MegatronBackend

        backend: Any = MegatronBackend(config, total_updates=100)
    else:
        from pipeline.trainer.torch_backend import TorchBackend

        backend = TorchBackend(config, total_updates=100)
    backend.load(model_dir, None)
    return backend


def hf_grads(backend: Any) -> dict[str, torch.Tensor]:
    """Unclipped-or-clipped gradients under HF names (only directions are compared, so clipping is irrelevant)."""
    if backend.__class__.__name__ == "MegatronBackend":
        from pipeline.trainer.megatron.convert import Shard, megatron_to_hf

        local: dict[str, torch.Tensor] = {}
        for k, p in backend.model.named_parameters():
            main_grad = getattr(p, "main_grad", None)  # megatron DDP accumulates into main_grad on GPU
            local[k] = main_grad if main_grad is not None else p.grad
        return {k: v.float().cpu() for k, v in megatron_to_hf([local], backend.dims, Shard()).items()}
    return {k: p.grad.float().cpu() for k, p in backend.model.named_parameters() if p.grad is not None}


def one_step(config: Any, model_dir: Path, plan: list[Any]) -> dict[str, Any]:
    backend = open_backend(config, model_dir)
    try:
        logp = torch.cat([backend.logprobs(m) * m.tokens.mask for m in plan])
        stats = backend.train_minibatch(plan, loss_fn_for(config))
        return {"logp": logp, "loss": stats.loss, "grad_norm": stats.grad_norm, "grads": hf_grads(backend)}
    finally:
        backend.close()


def errors(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    diff = (run["logp"] - ref["logp"]).abs()
    cos = [1 - torch.nn.functional.cosine_similarity(run["grads"][k].flatten(), g.flatten(), dim=0).item()
           for k, g in ref["grads"].items() if k != "lm_head.weight" and g.abs().sum() > 0]  # fmt: skip
    return {"logp_mean": float(diff.mean()), "logp_max": float(diff.max()),
            "loss_rel": abs(run["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12),
            "grad_norm_rel": abs(run["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
            "grad_1mcos_max": max(cos)}  # fmt: skip


def equivalence(work: Path) -> dict[str, Any]:
    model_dir = make_model(work / "small", SMALL, 2048)
    rows = make_rows(SMALL["vocab_size"], 2048, rows=4, median=300)
    runs = {}
    for name, backend, bf16 in [
        ("hf_fp32", "torch", False),
        ("hf_bf16", "torch", True),
        ("megatron_bf16", "megatron", True),
    ]:
        config = make_config(model_dir, work, backend, bf16, 2048)
        runs[name] = one_step(config, model_dir, make_plan(rows, config, 2048))
    hf, mg = errors(runs["hf_bf16"], runs["hf_fp32"]), errors(runs["megatron_bf16"], runs["hf_fp32"])
    verdict = {k: mg[k] <= 2 * hf[k] + 1e-3 for k in hf}
    print(f"{'error vs fp32':<16}{'hf bf16':>12}{'megatron bf16':>15}  ok (<= 2x hf + 1e-3)")
    for k in hf:
        print(f"{k:<16}{hf[k]:>12.3e}{mg[k]:>15.3e}  {verdict[k]}")
    return {"hf_bf16": hf, "megatron_bf16": mg, "pass": all(verdict.values())}


def throughput(work: Path, model: str, seq: int, rows: int, warmup: int, updates: int) -> dict[str, Any]:
    from pipeline.trainer.metrics import peak_flops

    shape = MODELS[model]
    model_dir = make_model(work / model, shape, seq)
    data = make_rows(shape["vocab_size"], seq, rows=rows, median=seq // 4)
    out: dict[str, Any] = {}
    for backend_name in ("megatron", "torch"):
        config = make_config(model_dir, work, backend_name, True, seq)
        backend = open_backend(config, model_dir)
        plan = make_plan(data, config, seq)
        loss_fn = loss_fn_for(config)
        try:
            for _ in range(warmup):
                backend.train_minibatch(plan, loss_fn)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(updates):
                backend.train_minibatch(plan, loss_fn)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            num_params = backend.num_params
        finally:
            backend.close()
        peak = peak_flops(torch.device("cuda"))
        tokens = sum(m.num_tokens for m in plan) * updates
        attn = sum(6 * shape["num_hidden_layers"] * shape["hidden_size"] * n * n for m in plan for n in m.lengths)
        flops = 6 * num_params * tokens + attn * updates
        out[backend_name] = {"tokens_per_s": tokens / elapsed, "params": num_params,
                             "mfu": 6 * num_params * tokens / elapsed / peak if peak else None,
                             "mfu_attn": flops / elapsed / peak if peak else None,
                             "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
    print(f"{'backend':<10}{'tokens/s':>12}{'MFU':>8}{'MFU+attn':>10}{'mem GiB':>9}")
    for name, r in out.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        mfu_a = f"{100 * r['mfu_attn']:.1f}%" if r["mfu_attn"] else "n/a"
        print(f"{name:<10}{r['tokens_per_s']:>12,.0f}{mfu:>8}{mfu_a:>10}{r['peak_mem_gib']:>9.1f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8, help="packed rows per optimizer update")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--skip-equivalence", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/megatron_gpu.py needs a CUDA GPU (run it through the device tool)")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": args.model, "seq": args.seq}
        if not args.skip_equivalence:
            result["equivalence"] = equivalence(work)
        result["throughput"] = throughput(work, args.model, args.seq, args.rows, args.warmup, args.updates)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
