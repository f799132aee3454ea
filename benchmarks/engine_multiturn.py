"""Multi-turn agent sessions on the `hf` engine, with and without prefix reuse (its prefix cache).

Work: S sessions of 8 turns. Turn 1's prompt is 200 random tokens; turn k+1's prompt is turn k's
prompt + its output + 20 new tokens (a tool result, a user message); every turn generates exactly
16 tokens (`ignore_eos`, temperature 1), streamed. The sessions of a run start together and each
sends its next turn as soon as the last one is answered (so at concurrency 16 the turns interleave);
at concurrency 1 three sessions run one after the other.

For each model and each concurrency S in (1, 16), two `hf` servers in their own processes
(`python -m pipeline.engine.server.hf.process`, CPU, fp32), one with `--prefix-cache-mb 0` (no reuse: every
turn recomputes its whole history) and one with the default budget (256 MB), run the same sessions
back to back (never at once: they would share the CPU). Models: the tiny model (`pipeline.demo.tiny_model`,
2 layers, hidden 128) and a larger random one of the same builder (6 layers, hidden 384), whose
prefill costs enough to matter. A warm-up session (2 short turns) precedes each measurement.

Figures: generated tokens per second over a whole run; time to first token (first streamed chunk)
per turn, averaged over the sessions, for turns 1 and 8; the share of turn 8's prompt served from the
cache (`meta_info.cached_tokens`). Reference: the same server with reuse off, same run. Targets:
reuse gives >= 2x tokens/s at concurrency 16 on the larger model, and with reuse turn 8's TTFT stays
within 1.5x of turn 1's there (without reuse it grows with the history).

Usage: `python benchmarks/engine_multiturn.py [--sessions 16] [--tiny-only] [--device cuda] [--larger 6x384]`.
Prints a table, then `RESULT {...}` (JSON) for `arl bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as `python benchmarks/engine_multiturn.py`: for `benchmarks.` imports
TURNS, FIRST, SUFFIX, NEW_TOKENS = 8, 200, 20, 16
SPEEDUP_TARGET = 2.0
TTFT_GROWTH_TARGET = 1.5
REUSE_MB = 256
ROUNDS = {1: 3}  # a lone session is short: three of them, one after the other, steady its figures


@dataclass
class Run:
    """One server configuration driving S sessions."""

    tok_s: float
    ttft: dict[int, float]  # turn (1-based) -> mean seconds over the sessions
    cached_share: dict[int, float] = field(default_factory=dict)  # turn -> mean cached_tokens / prompt tokens


async def turn(client: Any, url: str, prompt: list[int]) -> tuple[list[int], float, int]:
    """One streamed turn: (output ids, time to first token, cached prompt tokens)."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] = {}
    async with client.stream("POST", url + "/generate", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[len("data: ") :])
            if first is None and last["output_ids"]:
                first = time.perf_counter() - start
    assert first is not None and len(last["output_ids"]) == NEW_TOKENS, last
    return last["output_ids"], first, int(last["meta_info"].get("cached_tokens", 0))


async def session(client: Any, url: str, rng: random.Random, turns: int, first_len: int) -> list[tuple[float, float]]:
    """(ttft, cached share) per turn of one session."""
    prompt = [rng.randrange(3, 400) for _ in range(first_len)]
    out = []
    for _ in range(turns):
        output, ttft, cached = await turn(client, url, prompt)
        out.append((ttft, cached / len(prompt)))
        prompt = prompt + output + [rng.randrange(3, 400) for _ in range(SUFFIX)]
    return out


async def drive(url: str, sessions: int, seed: int) -> Run:
    """`sessions` concurrent sessions (`ROUNDS[sessions]` times over, one round after the other)."""
    import httpx

    rounds = ROUNDS.get(sessions, 1)
    results = []
    async with httpx.AsyncClient(timeout=600) as client:
        await session(client, url, random.Random(-1 - seed), turns=2, first_len=20)  # warm-up
        start = time.perf_counter()
        for r in range(rounds):
            results += await asyncio.gather(*(session(client, url, random.Random(seed * 1000 + r * 100 + s), TURNS,
                                                      FIRST) for s in range(sessions)))  # fmt: skip
        elapsed = time.perf_counter() - start
    ttft = {t + 1: statistics.mean(r[t][0] for r in results) for t in range(TURNS)}
    share = {t + 1: statistics.mean(r[t][1] for r in results) for t in range(TURNS)}
    return Run(rounds * sessions * TURNS * NEW_TOKENS / elapsed, ttft, share)


def bench_model(
    model_dir: Path, concurrencies: list[int], workdir: Path, name: str, device: str
) -> dict[tuple[int, int], Run]:
    """Runs keyed by (concurrency, prefix_cache_mb); each concurrency's pair measured back to back."""
    from benchmarks.engine_throughput import start_server, stop
    from pipeline.net.addresses import free_port

    runs: dict[tuple[int, int], Run] = {}
    servers = {}
    try:
        for mb in (0, REUSE_MB):
            port = free_port()
            argv = [sys.executable, "-m", "pipeline.engine.server.hf.process", "--model-path", str(model_dir), "--port",
                    str(port), "--device", device, "--max-batch-size", "64", "--seed", "0", "--prefix-cache-mb",
                    str(mb)]  # fmt: skip
            log = workdir / f"{name}_{mb}.log"
            path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
            servers[mb] = (start_server(argv, f"http://127.0.0.1:{port}", log, env={"PYTHONPATH": path}),
                           f"http://127.0.0.1:{port}")  # fmt: skip
        for c in concurrencies:
            for mb in (0, REUSE_MB):
                runs[(c, mb)] = asyncio.run(drive(servers[mb][1], c, seed=c))
                print(f"  {name} c={c} cache={mb}MB: {runs[(c, mb)].tok_s:.0f} tok/s", flush=True)
    finally:
        stop([proc for proc, _ in servers.values()])
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description="hf engine multi-turn sessions with and without prefix reuse")
    parser.add_argument("--sessions", type=int, default=16, help="the higher concurrency (the other is 1)")
    parser.add_argument("--tiny-only", action="store_true", help="skip the larger model")
    parser.add_argument("--device", default="cpu", help="the servers' device (cpu, cuda)")
    parser.add_argument("--larger", default="6x384", help="the larger model: LAYERSxHIDDEN")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the servers (see engine_throughput.py)
    from pipeline.demo.tiny_model import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="arl-multiturn-bench-"))
    concurrencies = [1, args.sessions]
    layers, hidden = (int(v) for v in args.larger.split("x"))
    models: dict[str, dict[str, int]] = {"tiny": {}, "larger": {"num_layers": layers, "hidden_size": hidden}}
    names = ["tiny"] if args.tiny_only else list(models)
    results = {}
    for name in names:
        model_dir = make_tiny_model(workdir / name, template="qwen", **models[name])
        results[name] = bench_model(model_dir, concurrencies, workdir, name, args.device)
    print(f"{TURNS} turns x {NEW_TOKENS} new tokens, first prompt {FIRST}, +{SUFFIX} per turn; {args.device} "
          f"({os.cpu_count()} CPU cores), fp32; larger model {args.larger} (layers x hidden)")  # fmt: skip
    print(f"{'model':>7} {'sessions':>8} {'reuse':>5} {'tok/s':>7} {'ttft t1 s':>9} {'ttft t8 s':>9} "
          f"{'t8/t1':>6} {'t8 cached':>9}")  # fmt: skip
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for name, runs in results.items():
        for (c, mb), run in sorted(runs.items()):
            label = f"{name}_c{c}_{'reuse' if mb else 'noreuse'}"
            growth = run.ttft[TURNS] / run.ttft[1]
            print(f"{name:>7} {c:>8} {'yes' if mb else 'no':>5} {run.tok_s:>7.0f} {run.ttft[1]:>9.3f} "
                  f"{run.ttft[TURNS]:>9.3f} {growth:>6.2f} {run.cached_share[TURNS]:>9.0%}")  # fmt: skip
            figures[f"{label}_tok_s"] = round(run.tok_s, 1)
            figures[f"{label}_ttft_t1_ms"] = round(1000 * run.ttft[1], 1)
            figures[f"{label}_ttft_t8_ms"] = round(1000 * run.ttft[TURNS], 1)
            ratios[f"{name} c{c} ttft t8/t1 {'reuse' if mb else 'no reuse'}"] = round(growth, 3)
        for c in concurrencies:
            ratios[f"{name} c{c} tok/s reuse/no reuse"] = round(runs[(c, REUSE_MB)].tok_s / runs[(c, 0)].tok_s, 3)
    judged = f"{'larger' if 'larger' in results else 'tiny'} c{args.sessions}"
    speedup = ratios[f"{judged} tok/s reuse/no reuse"]
    growth = ratios[f"{judged} ttft t8/t1 reuse"]
    targets = {
        f"{judged} tok/s reuse/no reuse >= {SPEEDUP_TARGET}": _verdict(speedup >= SPEEDUP_TARGET, speedup),
        f"{judged} ttft t8/t1 with reuse <= {TTFT_GROWTH_TARGET}": _verdict(growth <= TTFT_GROWTH_TARGET, growth),
    }
    result = {
        "name": "engine_multiturn",
        "figures": figures,
        "ratios": ratios,
        "reference": "the same sessions on an hf server with --prefix-cache-mb 0 (no reuse), same run",
        "targets": targets,
    }
    print("RESULT " + json.dumps(result))


def _verdict(met: bool, value: float) -> str:
    return "met" if met else f"missed ({value:.2f})"


if __name__ == "__main__":
    main()
