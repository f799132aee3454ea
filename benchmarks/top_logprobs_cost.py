"""What `top_logprobs_num` costs the `hf` engine, and that not asking costs nothing.

1. Sampling step alone (`pipeline.engine.server.hf.sampling.sample_batch`): B = 32 rows of logits over a
   Qwen-sized vocabulary (151,936), temperature 1, for k = 0 (no row asks), 5 and 20 (every row asks).
2. End to end: an in-process `hf` server on the tiny model (CPU, fp32), R requests of T tokens
   (`ignore_eos`, temperature 1) all in flight at once through `EngineClient`, non-streamed, streamed
   with SGLang's default cumulative events, and streamed by a server started with
   `--incremental-streaming-output`, for k = 0, 5 and 20. Rounds alternate the k values so that
   background load on a shared machine spreads over all of them; the median round is printed. On the
   tiny model a forward pass takes well under a millisecond, so per-token bookkeeping dominates: these
   ratios are upper bounds on the relative cost for a real model.

Usage: `python benchmarks/top_logprobs_cost.py [--requests 16] [--tokens 64] [--rounds 3]`.
Prints tables, then `RESULT {...}` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
KS = (0, 5, 20)


def sampling_step_ms(k: int, rows: int = 32, vocab: int = 151_936, repeats: int = 30) -> float:
    """Median milliseconds of one `sample_batch` call over [rows, vocab] logits."""
    import torch

    from pipeline.engine.server.hf.sampling import RowSampling, sample_batch

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    batch = [RowSampling(temperature=1.0, top_logprobs_num=k) for _ in range(rows)]
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample_batch(logits, batch, generator=generator)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


async def engine_tok_s(url: str, k: int, requests: int, tokens: int, stream: bool) -> float:
    from pipeline.engine.client import EngineClient

    params = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = [[5 + (i % 50), 6, 7, 8 + i % 7] for i in range(requests)]

    async def one(client: EngineClient, prompt: list[int]) -> int:
        if stream:
            return sum([len(c.new_ids) async for c in client.generate_stream(prompt, params, top_logprobs_num=k)])
        return len((await client.generate(prompt, params, top_logprobs_num=k)).output_ids)

    async with EngineClient([url], health_interval_s=0) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in prompts))
        return sum(counts) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.engine.server.hf.process import start_hf_server

    step = {k: sampling_step_ms(k) for k in KS}
    print("sample_batch, 32 rows x 151,936 vocabulary (median ms per step)")
    for k in KS:
        print(f"  k={k:2d}: {step[k]:7.2f} ms")
    modes = {"plain": (False, False), "stream": (True, False), "stream-incremental": (True, True)}
    results: dict[str, dict[int, list[float]]] = {mode: {k: [] for k in KS} for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", template="qwen")
        for incremental in (False, True):
            with start_hf_server(model, max_batch_size=64, incremental_streaming_output=incremental) as server:
                asyncio.run(engine_tok_s(server.url, 0, 4, 8, False))  # warm-up
                for _ in range(args.rounds):
                    for mode, (stream, inc) in modes.items():
                        if inc != incremental:
                            continue
                        for k in KS:
                            tok_s = asyncio.run(engine_tok_s(server.url, k, args.requests, args.tokens, stream))
                            results[mode][k].append(tok_s)
    print(f"\nhf server, tiny model, {args.requests} requests x {args.tokens} tokens in flight (median tok/s)")
    table: dict[str, Any] = {"sampling_step_ms": step}
    for mode, by_k in results.items():
        medians = {k: statistics.median(v) for k, v in by_k.items()}
        table[mode] = medians
        cells = "  ".join(f"k={k}: {v:7.1f} ({v / medians[0]:.2f}x)" for k, v in medians.items())
        print(f"  {mode:18s} {cells}")
    print("RESULT " + json.dumps(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
