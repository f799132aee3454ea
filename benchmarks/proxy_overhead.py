"""What the capture proxy adds to a completion: latency (p50/p99) and completions/s.

Three processes on this machine: the *instant engine* (benchmarks/instant_engine.py, answers
`/generate` with a fixed token list at once), the proxy (one process, `ProxyServer` on uvloop,
real tokenizer and chat template of the tiny model) and this load generator (aiohttp). Measured
at concurrency 1 and 64:

* `engine`: `POST /generate` straight to the instant engine, with the token ids of a first-turn prompt;
* `proxy`: `POST /v1/chat/completions` through the proxy to the same engine. Each worker runs
  multi-turn conversations of `--turns` calls in its own session (start_session is not timed), so
  the token-exact extension path is what is measured, not only first turns;
* `floor`: `GET /health` of the proxy app: the HTTP floor of our server stack.

Prints a table, the added milliseconds and ratios, and a final `RESULT {...}` JSON line.

    python benchmarks/proxy_overhead.py [--requests 2000] [--turns 8] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ADMIN = "bench-admin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout_s}s") from None
            time.sleep(0.1)


def serve_proxy(model_dir: str, engine_url: str, port: int) -> None:
    """The proxy process (run by this script with --serve-proxy)."""
    import uvloop

    from pipeline.engine.client import EngineClient
    from pipeline.proxy.server import ProxyServer
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    async def main() -> None:
        engine = EngineClient([engine_url], health_interval_s=0)
        proxy = ProxyServer(ModelConfig(path=model_dir), ProxyConfig(port=port, max_sessions=100_000), engine,
                            admin_key=ADMIN)  # fmt: skip
        await proxy.start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(kind: str, urls: dict[str, str], concurrency: int, total: int, turns: int,
               prompt_ids: list[int]) -> dict[str, float]:  # fmt: skip
    import aiohttp

    latencies: list[float] = []
    counter = {"left": total}
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def engine_worker() -> None:
            body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
            while counter["left"] > 0:
                counter["left"] -= 1
                t0 = time.perf_counter()
                async with http.post(urls["engine"] + "/generate", json=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        async def floor_worker() -> None:
            while counter["left"] > 0:
                counter["left"] -= 1
                t0 = time.perf_counter()
                async with http.get(urls["proxy"] + "/health") as r:
                    await r.read()
                latencies.append(time.perf_counter() - t0)

        async def proxy_worker() -> None:
            while counter["left"] > 0:
                admin = {"Authorization": f"Bearer {ADMIN}"}
                async with http.post(urls["proxy"] + "/rl/start_session", headers=admin) as r:
                    key = (await r.json())["api_key"]
                headers = {"Authorization": f"Bearer {key}"}
                messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."},
                                                  {"role": "user", "content": "What is 12 + 30?"}]  # fmt: skip
                for turn in range(turns):
                    if counter["left"] <= 0:
                        return
                    counter["left"] -= 1
                    t0 = time.perf_counter()
                    async with http.post(urls["proxy"] + "/v1/chat/completions", headers=headers,
                                         json={"model": "x", "messages": messages, "max_tokens": 16}) as r:  # fmt: skip
                        data = await r.json()
                        assert r.status == 200, data
                    latencies.append(time.perf_counter() - t0)
                    messages = [*messages, data["choices"][0]["message"],
                                {"role": "user", "content": f"And now add {turn}?"}]  # fmt: skip

        worker = {"engine": engine_worker, "floor": floor_worker, "proxy": proxy_worker}[kind]
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"p50_ms": 1000 * _percentile(latencies, 0.5), "p99_ms": 1000 * _percentile(latencies, 0.99),
            "per_s": len(latencies) / elapsed, "n": len(latencies)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement")
    parser.add_argument("--turns", type=int, default=8, help="calls per proxied conversation")
    parser.add_argument("--model-dir", default=None, help="tokenizer/template (default: a fresh tiny qwen model)")
    parser.add_argument("--serve-proxy", nargs=3, metavar=("MODEL_DIR", "ENGINE_URL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        serve_proxy(args.serve_proxy[0], args.serve_proxy[1], int(args.serve_proxy[2]))
        return
    sys.path.insert(0, str(REPO))
    import psutil
    import uvloop
    from transformers import AutoTokenizer

    from pipeline.demo.tiny_model import make_tiny_model

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_dir or str(make_tiny_model(Path(tmp.name) / "tiny", template="qwen"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    output = [*tok.encode("The answer is 42.", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    prompt_text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                          tokenize=False)  # fmt: skip
    prompt_ids: list[int] = tok.encode(str(prompt_text), add_special_tokens=False)
    eport, pport = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(HERE / "instant_engine.py"), "--port", str(eport),
                               "--tokens", ",".join(map(str, output))], env=env),
             subprocess.Popen([sys.executable, str(HERE / "proxy_overhead.py"), "--serve-proxy", model_dir,
                               f"http://127.0.0.1:{eport}", str(pport)], env=env)]  # fmt: skip
    try:
        urls = {"engine": f"http://127.0.0.1:{eport}", "proxy": f"http://127.0.0.1:{pport}"}
        _wait_http(urls["engine"] + "/health")
        _wait_http(urls["proxy"] + "/health")
        results: dict[str, Any] = {}
        proxy_proc = psutil.Process(procs[1].pid)
        for conc in (1, 64):
            for kind in ("floor", "engine", "proxy"):
                uvloop.run(_run(kind, urls, conc, max(50, args.requests // 10), args.turns, prompt_ids))  # warm-up
                cpu0 = sum(proxy_proc.cpu_times()[:2])
                result = uvloop.run(_run(kind, urls, conc, args.requests, args.turns, prompt_ids))
                # CPU the proxy process spent per request: unlike latency, barely affected by other load
                result["proxy_cpu_ms_per_req"] = 1000 * (sum(proxy_proc.cpu_times()[:2]) - cpu0) / result["n"]
                results[f"{kind}_c{conc}"] = result
        _report(results)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        tmp.cleanup()


def _report(results: dict[str, Any]) -> None:
    print(f"{'measurement':<14}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'proxy CPU ms/req':>18}")
    for name, r in results.items():
        cpu = r["proxy_cpu_ms_per_req"] if not name.startswith("engine") else float("nan")
        print(f"{name:<14}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['per_s']:>10.0f}{cpu:>18.3f}")
    summary: dict[str, Any] = {"results": results}
    for conc in (1, 64):
        p, e, f = results[f"proxy_c{conc}"], results[f"engine_c{conc}"], results[f"floor_c{conc}"]
        summary[f"added_p50_ms_c{conc}"] = p["p50_ms"] - e["p50_ms"]
        summary[f"added_p99_ms_c{conc}"] = p["p99_ms"] - e["p99_ms"]
        summary[f"latency_ratio_p50_c{conc}"] = p["p50_ms"] / e["p50_ms"]
        summary[f"throughput_ratio_c{conc}"] = p["per_s"] / e["per_s"]
        summary[f"proxy_over_floor_p50_ms_c{conc}"] = p["p50_ms"] - f["p50_ms"]
        print(f"concurrency {conc}: proxy adds {summary[f'added_p50_ms_c{conc}']:.2f} ms at p50 "
              f"({summary[f'latency_ratio_p50_c{conc}']:.2f}x the direct engine call), "
              f"{summary[f'added_p99_ms_c{conc}']:.2f} ms at p99; {p['per_s']:.0f} completions/s through the proxy "
              f"vs {e['per_s']:.0f}/s direct ({summary[f'throughput_ratio_c{conc}']:.2f}x)")  # fmt: skip
    cpu = results["proxy_c64"]["proxy_cpu_ms_per_req"]
    summary["proxy_cpu_ms_per_completion"] = cpu
    summary["completions_per_s_per_proxy_core"] = 1000 / cpu if cpu > 0 else None
    print(f"proxy CPU per completion: {cpu:.3f} ms -> {1000 / cpu:.0f} completions/s per core of proxy CPU "
          f"(the floor endpoint costs {results['floor_c64']['proxy_cpu_ms_per_req']:.3f} ms)")  # fmt: skip
    summary["target_added_p50_c1_ms"] = 2.0
    summary["target_completions_per_s_c64"] = 500
    summary["meets_targets"] = summary["added_p50_ms_c1"] <= 2.0 and results["proxy_c64"]["per_s"] >= 500
    print("RESULT " + json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
