"""Completions/s through one proxy process vs a pool of N worker processes (`proxy.workers`), in one run.

Processes on this machine: the *instant engine* (benchmarks/instant_engine.py: `/generate` answers a fixed
token list at once, so the proxy is the work), the proxy under test, and this load generator (aiohttp on
uvloop): all share the machine's cores, as they would share a rollout node. The proxy under test is
either `ProxyServer` in one process (`proxy.workers: 1`) or a pool (`pipeline.proxy.pool`) of N workers,
each serving the sessions started on it. At concurrency `--concurrency`, each load worker runs multi-turn
conversations of `--turns` calls in its own session, the sessions spread round-robin over the workers'
URLs (as `AgentRunner` spreads them). The two set-ups alternate `--rounds` times; the figures are the
medians per set-up. Proxy CPU per completion is the CPU time of the proxy's processes (all workers)
divided by the completions.

Prints a table and a final `RESULT {...}` JSON line (goal: `speedup` >= 1.5 with 2 workers at c=64). The
table's last column is what the cores allow: cores × 1000 / (proxy + engine + load generator CPU ms per
completion); where the load generator and the engine take a large share of the same cores, a second proxy
worker cannot raise completions/s past it.

    python benchmarks/proxy_workers.py [--workers 2] [--requests 4000] [--concurrency 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ADMIN = "bench-admin"


def serve(model_dir: str, engine_url: str, workers: int, out: str) -> None:
    """The proxy under test (run by this script with --serve): writes its URLs and pids to `out`, then serves."""
    sys.path.insert(0, str(REPO))
    import httpx

    from pipeline.engine.client import EngineClient
    from pipeline.proxy.pool import open_pool
    from pipeline.proxy.server import ProxyServer
    from pipeline.run.logs import run_async
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    model, proxy = ModelConfig(path=model_dir), ProxyConfig(max_sessions=100_000, workers=workers)

    def announce(urls: list[str], pids: list[int]) -> None:
        Path(out + ".tmp").write_text(json.dumps({"urls": urls, "pids": pids}))
        os.replace(out + ".tmp", out)

    async def until_terminated() -> None:  # SIGTERM ends the pool in order (its workers and shared counts)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    async def single() -> None:
        engine = EngineClient([engine_url], health_interval_s=0)
        server = ProxyServer(model, proxy, engine, admin_key=ADMIN)
        announce([await server.start()], [os.getpid()])
        await until_terminated()
        await server.stop()

    async def pooled() -> None:
        async with httpx.AsyncClient() as http, open_pool(model, proxy, admin_key=ADMIN, http=http,
                                                           engine_urls=[engine_url]) as (pool, _control):  # fmt: skip
            announce(pool.urls, [w.process.pid for w in pool.workers])
            await until_terminated()

    run_async(single() if workers == 1 else pooled())


async def _load(urls: list[str], concurrency: int, total: int, turns: int) -> dict[str, float]:
    import aiohttp

    done = {"left": total, "n": 0}
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def conversations(index: int) -> None:
            url = urls[index % len(urls)]
            while done["left"] > 0:
                async with http.post(url + "/rl/start_session", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                    key = (await r.json())["api_key"]
                headers = {"Authorization": f"Bearer {key}"}
                messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."},
                                                  {"role": "user", "content": "What is 12 + 30?"}]  # fmt: skip
                for turn in range(turns):
                    if done["left"] <= 0:
                        return
                    done["left"] -= 1
                    async with http.post(url + "/v1/chat/completions", headers=headers,
                                         json={"model": "x", "messages": messages, "max_tokens": 16}) as r:  # fmt: skip
                        data = await r.json()
                        assert r.status == 200, data
                    done["n"] += 1
                    messages = [*messages, data["choices"][0]["message"],
                                {"role": "user", "content": f"And now add {turn}?"}]  # fmt: skip
                async with http.post(url + "/rl/end_session", headers=headers, json={}) as r:
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(conversations(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"per_s": done["n"] / elapsed, "n": done["n"]}


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy under test exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the proxy under test did not announce itself in {timeout_s:g}s")
        time.sleep(0.2)
    return dict(json.loads(path.read_text()))


def measure(workers: int, model_dir: str, engine_url: str, engine_pid: int, args: argparse.Namespace,
            tmp: str) -> dict[str, float]:  # fmt: skip
    """Start the proxy with `workers`, warm it up, measure one round, stop it. Besides the proxy's CPU per
    completion, the engine's and this load generator's: all three share the cores, which bounds completions/s at
    cores / (their CPU per completion together), however many proxy workers there are."""
    import psutil
    import uvloop

    out = Path(tmp) / f"proxy-{workers}-{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(HERE / "proxy_workers.py"), "--serve", model_dir, engine_url,
                             str(workers), str(out)], env=env)  # fmt: skip
    try:
        info = _wait_file(out, proc)
        procs = [psutil.Process(pid) for pid in info["pids"]]
        engine, me = psutil.Process(engine_pid), psutil.Process()
        uvloop.run(_load(info["urls"], args.concurrency, max(200, args.requests // 10), args.turns))  # warm-up
        before = [sum(sum(p.cpu_times()[:2]) for p in procs), sum(engine.cpu_times()[:2]), sum(me.cpu_times()[:2])]
        result = uvloop.run(_load(info["urls"], args.concurrency, args.requests, args.turns))
        after = [sum(sum(p.cpu_times()[:2]) for p in procs), sum(engine.cpu_times()[:2]), sum(me.cpu_times()[:2])]
        for name, t0, t1 in zip(("proxy", "engine", "load"), before, after, strict=True):
            result[f"{name}_cpu_ms_per_completion"] = 1000 * (t1 - t0) / result["n"]
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers of the pool compared with one process")
    parser.add_argument("--requests", type=int, default=4000, help="completions per measurement")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8, help="calls per conversation")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two set-ups")
    parser.add_argument("--serve", nargs=4, metavar=("MODEL_DIR", "ENGINE_URL", "WORKERS", "OUT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), args.serve[3])
        return
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from benchmarks.proxy_overhead import _free_port, _wait_http
    from pipeline.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "tiny", template="qwen"))
        tok = AutoTokenizer.from_pretrained(model_dir)
        output = [*tok.encode("The answer is 42.", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
        port = _free_port()
        engine = subprocess.Popen([sys.executable, str(HERE / "instant_engine.py"), "--port", str(port),
                                   "--tokens", ",".join(map(str, output))],
                                  env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            engine_url = f"http://127.0.0.1:{port}"
            _wait_http(engine_url + "/health")
            runs: dict[int, list[dict[str, float]]] = {1: [], args.workers: []}
            for _ in range(args.rounds):
                for workers in (1, args.workers):
                    runs[workers].append(measure(workers, model_dir, engine_url, engine.pid, args, tmp))
                    print(f"workers={workers}: {runs[workers][-1]}", flush=True)
        finally:
            engine.terminate()
            engine.wait(timeout=10)
    _report(runs, args)


def _report(runs: dict[int, list[dict[str, float]]], args: argparse.Namespace) -> None:
    summary: dict[str, Any] = {"concurrency": args.concurrency, "turns": args.turns, "rounds": args.rounds,
                               "cpus": os.cpu_count(), "runs": runs}  # fmt: skip
    print(f"{'workers':<10}{'completions/s':>16}{'proxy CPU ms':>14}{'engine CPU ms':>15}{'load gen CPU ms':>17}"
          f"{'CPU bound /s':>14}")  # fmt: skip
    for workers, results in runs.items():
        per_s = statistics.median(r["per_s"] for r in results)
        cpu = {k: statistics.median(r[f"{k}_cpu_ms_per_completion"] for r in results)
               for k in ("proxy", "engine", "load")}  # fmt: skip
        bound = (os.cpu_count() or 1) * 1000 / sum(cpu.values())
        summary[f"completions_per_s_w{workers}"] = per_s
        summary[f"cpu_bound_per_s_w{workers}"] = bound
        for name, value in cpu.items():
            summary[f"{name}_cpu_ms_per_completion_w{workers}"] = value
        print(
            f"{workers:<10}{per_s:>16.0f}{cpu['proxy']:>14.3f}{cpu['engine']:>15.3f}{cpu['load']:>17.3f}{bound:>14.0f}"
        )
    speedup = summary[f"completions_per_s_w{args.workers}"] / summary["completions_per_s_w1"]
    paired = [b["per_s"] / a["per_s"] for a, b in zip(runs[1], runs[args.workers], strict=True)]
    summary.update(speedup=speedup, speedup_per_round=paired, target_speedup=1.5, meets_target=speedup >= 1.5)
    print(f"{args.workers} workers vs 1: {speedup:.2f}x completions/s at concurrency {args.concurrency} "
          f"(per round: {', '.join(f'{p:.2f}x' for p in paired)}; goal >= 1.5x)")  # fmt: skip
    print("RESULT " + json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
