"""Throughput of the `hf` engine server against plain batched `model.generate` of the same work (its ceiling).

Work: R requests with prompts of 8–40 tokens (fixed seed), each generating exactly T tokens
(`ignore_eos`), temperature 1, logprobs returned. For each concurrency C in (1, 8, 32):

* server: an `hf` server in its own process (`python -m pipeline.engine.server.hf.process`, CPU, fp32,
  max batch 64), driven over HTTP by `EngineClient` with at most C requests in flight;
* ceiling: `model.generate` in this process on the same prompts in batches of C (left-padded),
  `min_new_tokens = max_new_tokens = T`, sampling, scores kept (the engine computes logprobs too);
* vLLM (only when `.vllm-venv` exists): the `vllm` backend (vLLM CPU server with `--enforce-eager`,
  since its torch.compile warm-up takes minutes on a shared CPU, + our adapter) on the
  same requests through the same client.

Tokens/s counts generated tokens only. The ratio server/ceiling is printed per concurrency; the
target is >= 0.90 at C = 32. For each C the server and the ceiling are measured back to back (never
at once, so they do not share the CPU), both with `OMP_WAIT_POLICY=PASSIVE` (see hf_server.main).
Usage: `python benchmarks/engine_throughput.py [--requests 64] [--tokens 64] [--no-vllm]`.
Prints a table, then `RESULT {...}` (JSON) for `arl bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
CONCURRENCY = (1, 8, 32)
TARGET = 0.90


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 20) for _ in range(rng.randint(8, 40))] for _ in range(count)]


def generate_ceiling(model_dir: Path, prompts: list[list[int]], tokens: int, batch: int) -> float:
    """Generated tokens per second of batched `model.generate` (same prompts, batches of `batch`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0

    def run(group: list[list[int]]) -> None:
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )

    run(prompts[:batch])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run(prompts[i : i + batch])
    return len(prompts) * tokens / (time.perf_counter() - start)


async def drive(url: str, prompts: list[list[int]], tokens: int, concurrency: int) -> float:
    """Generated tokens per second over HTTP with at most `concurrency` requests in flight."""
    from pipeline.engine.client import EngineClient

    params = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient([url], health_interval_s=0) as client:

        async def one(prompt: list[int]) -> int:
            async with gate:
                return len((await client.generate(prompt, params)).output_ids)

        await asyncio.gather(*(one(p) for p in prompts[:concurrency]))  # warm-up
        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(p) for p in prompts)))
        elapsed = time.perf_counter() - start
    assert produced == len(prompts) * tokens, f"expected {len(prompts) * tokens} tokens, got {produced}"
    return produced / elapsed


def start_server(
    argv: list[str], url: str, log: Path, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    import httpx

    handle = open(log, "wb")  # noqa: SIM115 - the child owns it until it exits
    proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not healthy after {timeout_s}s; log {log}")
        time.sleep(0.3)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_hf(
    model_dir: Path, prompts: list[list[int]], tokens: int, workdir: Path
) -> tuple[dict[int, float], dict[int, float]]:
    """(server tok/s, generate tok/s) per concurrency, each pair measured back to back.

    Pairing keeps the ratio honest on a shared machine whose background load drifts over minutes.
    """
    from pipeline.net.addresses import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "pipeline.engine.server.hf.process",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-batch-size",
        "64",
        "--seed",
        "0",
    ]
    proc = start_server(argv, url, workdir / "hf_server.log", env={"PYTHONPATH": str(REPO_ROOT)})
    server, ceiling = {}, {}
    try:
        for c in CONCURRENCY:
            server[c] = asyncio.run(drive(url, prompts, tokens, c))
            ceiling[c] = generate_ceiling(model_dir, prompts, tokens, c)
    finally:
        stop([proc])
    return server, ceiling


def bench_vllm(model_dir: Path, prompts: list[list[int]], tokens: int, workdir: Path) -> dict[int, float] | None:
    venv_python = REPO_ROOT / ".vllm-venv" / "bin" / "python"
    if not venv_python.exists():
        print("vLLM: .vllm-venv absent (scripts/vllm_venv.sh builds it); skipped")
        return None
    from pipeline.engine.inference.procs import vllm_procs
    from pipeline.net.addresses import free_port
    from pipeline.run.config import load_config

    port = free_port()
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "inference.backend=vllm",
            f"inference.python={venv_python}",
            "model.max_context=2048",
            "inference.max_batch_size=64",
            "inference.extra_args=[--enforce-eager]",
        ],
    )
    specs = vllm_procs(config, host="127.0.0.1", port=port, model_path=str(model_dir), version=0)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, spec in enumerate(specs):
            url = spec.health_url or f"http://127.0.0.1:{port}"
            procs.append(start_server(spec.argv, url, workdir / f"vllm_{i}.log", env=spec.env))
        return {c: asyncio.run(drive(f"http://127.0.0.1:{port}", prompts, tokens, c)) for c in CONCURRENCY}
    finally:
        stop(list(reversed(procs)))


def main() -> None:
    parser = argparse.ArgumentParser(description="hf engine throughput vs batched model.generate")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: a fresh tiny model)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM server even when .vllm-venv exists")
    args = parser.parse_args()
    # Same OpenMP setting as the server (hf_server.main sets it): idle workers sleep instead of spinning,
    # which on a busy CPU otherwise slows both sides many times over. Must precede the torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    workdir = Path(tempfile.mkdtemp(prefix="arl-engine-bench-"))
    model_dir = args.model
    if model_dir is None:
        from pipeline.demo.tiny_model import make_tiny_model

        model_dir = make_tiny_model(workdir / "tiny", template="qwen")
    prompts = make_prompts(args.requests, vocab=500)
    server, ceiling = bench_hf(model_dir, prompts, args.tokens, workdir)
    vllm = None if args.no_vllm else bench_vllm(model_dir, prompts, args.tokens, workdir)
    print(f"{args.requests} requests x {args.tokens} tokens, tiny model, CPU ({os.cpu_count()} cores)")
    header = f"{'concurrency':>11} {'hf server tok/s':>16} {'generate tok/s':>15} {'ratio':>6}"
    print(header + (" vllm tok/s" if vllm else ""))
    for c in CONCURRENCY:
        extra = f" {vllm[c]:>10.0f}" if vllm else ""
        print(f"{c:>11} {server[c]:>16.0f} {ceiling[c]:>15.0f} {server[c] / ceiling[c]:>6.2f}{extra}")
    ratio32 = server[32] / ceiling[32]
    figures: dict[str, Any] = {f"hf_c{c}_tok_s": round(server[c], 1) for c in CONCURRENCY}
    figures.update({f"generate_c{c}_tok_s": round(ceiling[c], 1) for c in CONCURRENCY})
    if vllm:
        figures.update({f"vllm_c{c}_tok_s": round(vllm[c], 1) for c in CONCURRENCY})
    result = {
        "name": "engine_throughput",
        "figures": figures,
        "ratios": {f"hf/generate c{c}": round(server[c] / ceiling[c], 3) for c in CONCURRENCY},
        "reference": "batched model.generate of the same prompts and token counts, same run (the ceiling)",
        "targets": {"hf/generate c32 >= 0.90": "met" if ratio32 >= TARGET else f"missed ({ratio32:.2f})"},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
