"""An outside agent feeding a standalone arl proxy (`arl stage proxy`) from any machine.

    python examples/external_agent.py RUN_DIR_OR_PROXY_URL --client-key ck-example-team

Each run is one `AgentSession`: the agent is an ordinary OpenAI-SDK program given the session's
`base_url` and `api_key`; the value it returns is the reward (None would reject the run). Only
`pipeline.client` (httpx) is needed on the agent's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def main(proxy: str, client_key: str, data_path: Path, group_size: int, limit: int | None) -> None:
    rows = [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()][:limit]
    runner = AgentRunner(proxy, client_key=client_key, group_size=group_size, max_concurrency=8)
    summary = await runner.run(solve, rows)
    print(f"{summary.runs} runs: {summary.finished} finished, {summary.failed} failed, "
          f"{summary.rejected} rejected, reward mean {summary.reward_mean}, {summary.duration_s:.1f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("proxy", help="the run dir (reads registry/proxy/) or the proxy URL")
    parser.add_argument("--client-key", required=True, help="one of the proxy's proxy.client_keys")
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "external.jsonl")
    parser.add_argument("--group-size", type=int, default=4, help="runs per question (a GRPO group)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    args = parser.parse_args()
    asyncio.run(main(args.proxy, args.client_key, args.data, args.group_size, args.limit))
