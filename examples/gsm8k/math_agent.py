"""A GSM8K-style math agent: an ordinary OpenAI-SDK program; the reward is exact-match on the answer.

Data rows look like GSM8K's: `{"question": "...", "answer": "... reasoning ... #### 42"}`.
The model is asked to end with `#### <number>`; the last number in the reply is compared with the
reference (commas and a trailing `.0` ignored).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
from openai import AsyncOpenAI

SYSTEM = "Solve the math problem step by step. End your reply with '#### <answer>' where <answer> is a number."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after the last `####`, else the last number in the text; normalised."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


class MathAgent:
    required_fields = ("question", "answer")

    def __init__(self, max_tokens: int = 1024, model: str = "arl-policy") -> None:
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
        completion = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": data["question"]}],
            max_tokens=self.max_tokens,
            temperature=temperature,
        )
        predicted = final_number(completion.choices[0].message.content or "")
        return 1.0 if predicted is not None and predicted == final_number(data["answer"]) else 0.0
