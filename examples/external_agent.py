"""An outside agent feeding a standalone arl proxy (`arl stage proxy`) from any machine.

    python examples/external_agent.py RUN_DIR_OR_PROXY_URL --client-key ck-example-team [--until-done]

Each run is one `AgentSession`: the agent is an ordinary OpenAI-SDK program given the session's
`base_url` and `api_key`; the value it returns is the reward (None would reject the run). Only
`pipeline.client` (httpx) is needed on the agent's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from pipeline.client import AgentRunner, AgentSession


async def solve(session: AgentSession, data: dict[str, Any]) -> float:
    """The agent: one question, one answer, reward 1 if the answer holds the right number."""
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    completion = await client.chat.completions.create(
        model="arl-policy", messages=[{"role": "user", "content": data["question"]}], max_tokens=16
    )
    return float(str(data["answer"]) in (completion.choices[0].message.content or ""))


async def main(proxy: str, client_key: str, data_path: Path, group_size: int, limit: int | None,
               until_done: bool) -> None:  # fmt: skip
    rows = [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()][:limit]
    while True:
        # The proxy is looked up again on every pass: a restarted proxy stage may listen elsewhere.
        if until_done:
            await wait_for_proxy(Path(proxy), timeout_s=900.0)
        runner = AgentRunner(proxy, client_key=client_key, group_size=group_size, max_concurrency=8)
        summary = await runner.run(solve, rows)
        print(f"{summary.runs} runs: {summary.finished} finished, {summary.failed} failed, "
              f"{summary.rejected} rejected, reward mean {summary.reward_mean}, {summary.duration_s:.1f}s",
              flush=True)  # fmt: skip
        if not until_done or run_is_done(Path(proxy)):
            return
        if summary.finished == 0:
            await asyncio.sleep(2.0)  # the proxy is down or admits nobody: do not spin


async def wait_for_proxy(run_dir: Path, timeout_s: float) -> None:
    """Until the run's proxy stage has registered (an agent may start before it, e.g. right after launch)."""
    deadline = time.monotonic() + timeout_s
    while not any(run_dir.joinpath("registry", "proxy").glob("*.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no proxy registered under {run_dir}/registry/proxy after {timeout_s:.0f}s: is the "
                               f"run's proxy stage running? (arl status {run_dir})")  # fmt: skip
        await asyncio.sleep(1.0)


def run_is_done(run_dir: Path) -> bool:
    """True once the trainer published the run's last weight version (`num_steps` of its frozen config)."""
    from pipeline.run.config import load_config
    from pipeline.run.paths import RunPaths
    from pipeline.run.weight_version import published_version

    paths = RunPaths(run_dir)
    return published_version(paths) >= load_config(paths.config, []).num_steps


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("proxy", help="the run dir (reads registry/proxy/) or the proxy URL")
    parser.add_argument("--client-key", required=True, help="one of the proxy's proxy.client_keys")
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "external.jsonl")
    parser.add_argument("--group-size", type=int, default=4, help="runs per question (a GRPO group)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--until-done", action="store_true",
                        help="go over the data again and again until the run has trained all its steps "
                        "(needs the run dir as PROXY)")  # fmt: skip
    args = parser.parse_args()
    if args.until_done and not Path(args.proxy, "config.yaml").exists():
        parser.error(f"--until-done needs a run dir (with config.yaml) as PROXY, not {args.proxy!r}")
    asyncio.run(main(args.proxy, args.client_key, args.data, args.group_size, args.limit, args.until_done))
