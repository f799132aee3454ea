"""The demo's agent: an ordinary OpenAI-SDK program with no arl code in it.

Task: the user asks the model to repeat a two-digit number. The reward is graded so that a
random-init tiny model has a gradient to climb: half for how much of the reply is digits, half
for starting with the right number. A 0.5M-parameter model goes from ~0.01 to ~0.5+ within a
few dozen GRPO steps on CPU.
"""

from __future__ import annotations

from typing import Any

import httpx
from openai import AsyncOpenAI


def score(reply: str, number: str) -> float:
    """0.5 × fraction of digit characters + 0.5 × (reply starts with the number)."""
    text = reply.strip()
    if not text:
        return 0.0
    digits = sum(ch.isdigit() for ch in text) / len(text)
    return 0.5 * digits + 0.5 * float(text.startswith(number))


class DemoAgent:
    """`run` is all arl needs: it gets an OpenAI-compatible endpoint and returns a reward."""

    required_fields = ("number",)
    """Dataset fields `run` reads (optional; `arl check` and `arl launch` check the dataset has them)."""

    def __init__(self, max_tokens: int = 6, model: str = "arl-policy") -> None:
        self.max_tokens = max_tokens
        self.model = model

    async def run(
        self,
        data: dict[str, Any],
        *,
        base_url: str,
        api_key: str,
        http_client: httpx.AsyncClient | None = None,
        temperature: float = 1.0,
        **_: Any,
    ) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        number = str(data["number"])
        completion = await client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": "Answer with digits only."},
                {"role": "user", "content": f"Repeat the number {number}."},
            ],
            max_tokens=self.max_tokens,
            temperature=temperature,
        )
        return score(completion.choices[0].message.content or "", number)
