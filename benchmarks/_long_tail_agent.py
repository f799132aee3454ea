"""A benchmark agent whose replies have long-tailed lengths, as real agents' turns do (`async_vs_sync.py` runs
it; the leading underscore keeps `arl bench` from running it as a benchmark).

The demo's task (`examples/demo_agent.py`: repeat a number, graded reward), but each run asks for
`short` tokens most of the time and `long` tokens with probability `long_share`, drawn from a generator
seeded by the prompt and the run's own draw (so the three runs of `async_vs_sync.py` see the same mix).
A random-init tiny model almost never samples EOS, so each reply runs to its `max_tokens`: a step's
rollout then ends with a few long replies decoding in a shrinking batch, which is where a publication
that waits for the requests in flight (`inference.update_mode: wait`) loses time and one that pauses
and continues them (`interrupt`) does not. Reward: the demo's score of the reply's first 8 characters.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from demo_agent import score  # the demo's own reward, next to it in examples/


class LongTailAgent:
    def __init__(self, short: int = 8, long: int = 160, long_share: float = 0.15, model: str = "arl-policy") -> None:
        self.short, self.long, self.long_share, self.model = short, long, long_share, model
        self.draws = random.Random(0)

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str,
                  http_client: httpx.AsyncClient | None = None, temperature: float = 1.0,
                  **_: Any) -> float:  # fmt: skip
        number = str(data["number"])
        rng = random.Random(f"{number}-{self.draws.random()}")
        max_tokens = self.long if rng.random() < self.long_share else self.short
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        completion = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "system", "content": "Answer with digits only."},
                      {"role": "user", "content": f"Repeat the number {number}."}],
            max_tokens=max_tokens,
            temperature=temperature,
        )  # fmt: skip
        return score((completion.choices[0].message.content or "")[:8], number)
