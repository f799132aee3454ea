"""Load: many concurrent agent sessions × multi-turn tool use through one proxy and the `hf` engine.

Three kinds of process on this machine: the `hf` engine (`python -m pipeline.engine.server.hf.process`,
the tiny model), one proxy (`benchmarks/_proxy_stack.py`: `ProxyServer` as the stages run it)
and this load generator, whose agents use the real OpenAI SDK. Each session runs `--turns` calls
with a calculator tool; after a call the agent appends the assistant message and a tool result
to its history, so later turns extend earlier ones. Sessions cover every combination of:

* history kept exactly as returned (token-exact extension) or rewritten by the agent into its own
  tool-call assistant message (what some frameworks do: a prefix break every turn);
* export style `individual` or `concat`;
* streaming or not.

After every session has ended and been exported, the round is checked: every completion the
agents received is exported exactly once, in its own session (each session's prompt carries a
nonce), with prompt/output token counts equal to what the API reported, masks and log-probs of
the right length, and each exact turn's prompt starting with the previous turn's prompt + output.
Between rounds the proxy's RSS (psutil, after a `gc.collect()` in the proxy), its live Python
objects and its session table are read: a leak grows them round after round.

Prints per-round figures and a final `RESULT {...}` line (see `pipeline/analysis/bench.py`). p99 latency is
reported, not asserted; `tests/integration/test_load.py` asserts the correctness figures.

    python benchmarks/proxy_load.py [--sessions 256] [--turns 4] [--rounds 2] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/proxy_load.py`: the root, for `benchmarks.` imports
# The processes (re-exported: tests import this script as their harness and call these by name).
from benchmarks._proxy_stack import Stack, start_engine, start_proxy, start_stack  # noqa: E402

__all__ = ["Stack", "start_engine", "start_proxy", "start_stack"]
CALCULATOR = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
TOOLS = [{"type": "function", "function": CALCULATOR}]


# -- the agents -------------------------------------------------------------------------------
@dataclass
class Call:
    id: str
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float


@dataclass
class SessionRun:
    index: int
    session_id: str
    nonce: str
    edit: bool
    style: str
    stream: bool
    calls: list[Call] = field(default_factory=list)
    export: dict[str, Any] | None = None
    error: str | None = None


def session_kind(index: int) -> tuple[bool, str, bool]:
    """(edit history, export style, stream) for session `index`: every combination in turn."""
    return bool(index & 1), ("individual", "concat")[(index >> 1) & 1], bool((index >> 2) & 1)


async def _call(client: Any, messages: list[dict[str, Any]], max_tokens: int, stream: bool) -> tuple[dict, Call]:
    """One chat completion; returns (assistant message as the agent keeps it, what was observed)."""
    started = time.perf_counter()
    if not stream:
        reply = await client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS,
                                                     max_tokens=max_tokens, temperature=1.0)  # fmt: skip
        kept = reply.choices[0].message.model_dump(exclude_none=True)
        usage = reply.usage
        return kept, Call(reply.id, usage.prompt_tokens, usage.completion_tokens, time.perf_counter() - started)
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    cid, usage = "", None
    chunks = await client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS, stream=True,
                                                  max_tokens=max_tokens, temperature=1.0,
                                                  stream_options={"include_usage": True})  # fmt: skip
    async for chunk in chunks:
        cid = chunk.id or cid
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})  # fmt: skip
                entry["function"]["name"] += (tc.function.name or "") if tc.function else ""
                entry["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    observed = Call(cid, usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None,
                    time.perf_counter() - started)  # fmt: skip
    return message, observed


def _next_history(run: SessionRun, messages: list[dict[str, Any]], message: dict[str, Any], turn: int) -> list[dict]:
    """The history an agent sends next: the reply (kept or rewritten as a tool call) + a tool result."""
    calls = message.get("tool_calls") or []
    if run.edit or not calls:
        call_id = f"call_{run.nonce}_{turn}"
        if run.edit:  # the agent replaces the reply with its own tool-call message: a prefix break
            arguments = json.dumps({"expression": f"{turn}+1"})
            calls = [{"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}]
            message = {"role": "assistant", "content": "", "tool_calls": calls}
    else:
        call_id = calls[0]["id"]
    return [*messages, message, {"role": "tool", "tool_call_id": call_id, "content": str(turn + 1)}]


async def run_session(index: int, proxy_url: str, admin_key: str, http: Any, turns: int, max_tokens: int) -> SessionRun:
    from openai import AsyncOpenAI

    edit, style, stream = session_kind(index)
    admin = {"Authorization": f"Bearer {admin_key}"}
    started = await http.post(f"{proxy_url}/rl/start_session", headers=admin, json={"metadata": {"index": index}})
    started.raise_for_status()
    info = started.json()
    run = SessionRun(index, info["session_id"], secrets.token_hex(4), edit, style, stream)
    try:
        client = AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=info["api_key"], http_client=http, max_retries=0)
        task = f"task {run.nonce}: add {index} and 1"
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the calculator."},
                                          {"role": "user", "content": task}]  # fmt: skip
        for turn in range(turns):
            message, call = await _call(client, messages, max_tokens, stream)
            run.calls.append(call)
            messages = _next_history(run, messages, message, turn)
        key = {"Authorization": f"Bearer {info['api_key']}"}
        reward = await http.post(f"{proxy_url}/rl/set_reward", headers=key, json={"reward": float(index % 3)})
        reward.raise_for_status()
        (await http.post(f"{proxy_url}/rl/end_session", headers=key)).raise_for_status()
    except Exception as exc:  # counted, and the session is still exported so the proxy forgets it
        run.error = f"{type(exc).__name__}: {exc}"
        await http.post(f"{proxy_url}/rl/end_session", headers=admin, json={"session_id": run.session_id})
    exported = await http.post(f"{proxy_url}/export_trajectories", headers=admin,
                               json={"session_id": run.session_id, "discount": 1.0, "style": style})  # fmt: skip
    if exported.status_code == 200:
        run.export = exported.json()
    elif run.error is None:
        run.error = f"export answered {exported.status_code}: {exported.text[:300]}"
    return run


# -- checks -----------------------------------------------------------------------------------
def check_session(run: SessionRun, tokenizer: Any) -> list[str]:
    """Everything wrong with one session's export (empty when it is consistent)."""
    where = f"session {run.index} ({run.session_id}, edit={run.edit}, {run.style}, stream={run.stream})"
    if run.error is not None:
        return [f"{where}: {run.error}"]
    assert run.export is not None
    rows = run.export["samples"]
    problems: list[str] = []
    ids = [c.id for c in run.calls]
    if run.export["num_interactions"] != len(ids):
        problems.append(f"{where}: proxy recorded {run.export['num_interactions']} interactions, agent made {len(ids)}")
    expected_rows = ids if (run.style == "individual" or run.edit) else ids[-1:]
    got = [r["sample_id"] for r in rows]
    if sorted(got) != sorted(expected_rows):
        problems.append(f"{where}: exported sample ids {got} != expected {expected_rows}")
    for row in rows:
        problems += _check_row(where, row, run, tokenizer)
    if run.style == "individual" and not run.edit and len(rows) == len(ids):
        by_id = {r["sample_id"]: r for r in rows}
        for prev, cur in itertools.pairwise(ids):
            a, b = by_id.get(prev), by_id.get(cur)
            if a and b and b["input_ids"][: len(a["input_ids"])] != a["input_ids"]:
                problems.append(f"{where}: turn {cur} does not extend {prev} token-exactly")
    if run.style == "concat" and not run.edit and rows:
        sampled = sum(c.completion_tokens or 0 for c in run.calls)
        if sum(rows[0]["loss_mask"]) != sampled:
            problems.append(f"{where}: concat row masks {sum(rows[0]['loss_mask'])} tokens, agents got {sampled}")
    breaks = run.export["prefix_breaks"]
    if breaks != (len(ids) - 1 if run.edit else 0):
        problems.append(f"{where}: {breaks} prefix breaks recorded")
    return problems


def _check_row(where: str, row: dict[str, Any], run: SessionRun, tokenizer: Any) -> list[str]:
    problems = []
    n = len(row["input_ids"])
    if not (len(row["loss_mask"]) == len(row["logprobs"]) == len(row["versions"]) == n):
        problems.append(f"{where}: row {row['sample_id']} list columns differ in length")
    if row["session_id"] != run.session_id:
        problems.append(f"{where}: row {row['sample_id']} belongs to session {row['session_id']}")
    if run.nonce not in tokenizer.decode(row["input_ids"][: row["prompt_len"]]):
        problems.append(f"{where}: row {row['sample_id']}'s prompt lacks the session's nonce (mixed sessions?)")
    call = next((c for c in run.calls if c.id == row["sample_id"]), None)
    if call is not None and (run.style == "individual" or run.edit):
        if call.prompt_tokens is not None and call.prompt_tokens != row["prompt_len"]:
            problems.append(f"{where}: {call.id} prompt_len {row['prompt_len']} != usage {call.prompt_tokens}")
        if call.completion_tokens is not None and call.completion_tokens != n - row["prompt_len"]:
            problems.append(f"{where}: {call.id} has {n - row['prompt_len']} output tokens, usage said "
                            f"{call.completion_tokens}")  # fmt: skip
        if sum(row["loss_mask"]) != n - row["prompt_len"] or any(row["loss_mask"][: row["prompt_len"]]):
            problems.append(f"{where}: {call.id} loss mask does not cover exactly the output")
    return problems


@dataclass
class RoundReport:
    sessions: int
    completions: int
    exported_rows: int
    problems: list[str]
    latencies_s: list[float]
    wall_s: float

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_round(stack: Stack, tokenizer: Any, *, sessions: int, turns: int, max_tokens: int,
                    timeout_s: float = 900.0) -> RoundReport:  # fmt: skip
    """`sessions` concurrent sessions; every one is checked after the round."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=sessions + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
        started = time.perf_counter()
        runs = await asyncio.wait_for(asyncio.gather(*(
            run_session(i, stack.proxy_url, stack.admin_key, http, turns, max_tokens) for i in range(sessions))),
            timeout_s)  # fmt: skip
        wall = time.perf_counter() - started
    problems = [p for run in runs for p in check_session(run, tokenizer)]
    completions = sum(len(r.calls) for r in runs)
    rows = sum(len(r.export["samples"]) for r in runs if r.export)
    return RoundReport(sessions, completions, rows, problems, [c.latency_s for r in runs for c in r.calls], wall)


def proxy_stats(stack: Stack) -> dict[str, Any]:
    """The proxy's session table and live objects (after its gc) and its RSS read from outside."""
    import httpx
    import psutil

    reply = httpx.get(f"{stack.proxy_url}/_load/stats", headers={"Authorization": f"Bearer {stack.admin_key}"},
                      timeout=60)  # fmt: skip
    reply.raise_for_status()
    stats = dict(reply.json())
    stats["rss_mb"] = psutil.Process(stack.proxy.pid).memory_info().rss / 2**20
    return stats


# -- main -------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="rounds after a warm-up round (leak check)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model-dir", default=None, help="default: a fresh tiny qwen model")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from pipeline.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or str(make_tiny_model(Path(tmp) / "tiny", template="qwen"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        stack = start_stack(model_dir, Path(tmp))
        try:
            summary = _measure(stack, tokenizer, args)
        finally:
            stack.close()
    print("RESULT " + json.dumps(summary, sort_keys=True))


def _measure(stack: Stack, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    warm = asyncio.run(run_round(stack, tokenizer, sessions=min(32, args.sessions), turns=args.turns,
                                 max_tokens=args.max_tokens))  # fmt: skip
    baseline = proxy_stats(stack)
    print(f"warm-up: {warm.completions} completions; proxy baseline {baseline}")
    reports, stats = [], []
    for i in range(args.rounds):
        report = asyncio.run(run_round(stack, tokenizer, sessions=args.sessions, turns=args.turns,
                                       max_tokens=args.max_tokens))  # fmt: skip
        reports.append(report)
        stats.append(proxy_stats(stack))
        print(f"round {i}: {report.sessions} sessions, {report.completions} completions in {report.wall_s:.1f}s "
              f"({report.completions / report.wall_s:.0f}/s), p50 {report.percentile_ms(0.5):.0f} ms, "
              f"p99 {report.percentile_ms(0.99):.0f} ms, {len(report.problems)} problems; "
              f"proxy {stats[-1]}")  # fmt: skip
        for problem in report.problems[:10]:
            print("   ", problem)
    latencies = [x for r in reports for x in r.latencies_s]
    overall = RoundReport(0, 0, 0, [], latencies, 0.0)
    figures = {
        "sessions_per_round": args.sessions, "turns": args.turns, "rounds": args.rounds,
        "completions": sum(r.completions for r in reports),
        "completions_per_s": sum(r.completions for r in reports) / sum(r.wall_s for r in reports),
        "p50_ms": overall.percentile_ms(0.5), "p99_ms": overall.percentile_ms(0.99),
        "lost_or_mismatched": sum(len(r.problems) for r in reports),
        "proxy_rss_mb_baseline": baseline["rss_mb"], "proxy_rss_mb_after": stats[-1]["rss_mb"],
        "proxy_objects_baseline": baseline["objects"], "proxy_objects_after": stats[-1]["objects"],
        "proxy_sessions_after": stats[-1]["sessions"],
    }  # fmt: skip
    return {"name": "proxy_load", "figures": figures,
            "ratios": {"rss_after_over_baseline": stats[-1]["rss_mb"] / baseline["rss_mb"]},
            "reference": "proxy RSS after a warm-up round of 32 sessions",
            "targets": {"zero lost or mismatched": "met" if figures["lost_or_mismatched"] == 0 else "missed",
                        "no sessions left": "met" if figures["proxy_sessions_after"] == 0 else "missed"}}  # fmt: skip


if __name__ == "__main__":
    main()
