"""The demo's agent: an ordinary OpenAI-SDK program with no arl code in it.

Task: the user asks the model to repeat a two-digit number ("Repeat 59."); the reply
should be exactly that number. `score` grades a reply:

    0.2 x [the reply is exactly two digits]
  + 0.4 x [its first character is the number's first digit]
  + 0.4 x [its second character is the number's second digit]

so only the exact number scores 1.0, and `exact_correct` (reply == number, after stripping
whitespace) is reported beside the reward as the run's metric `agent/exact_correct`.

Why the reward measures the task, not the format: a policy that ignores the prompt answers from one
distribution for every prompt, and its expected score is at most that of its best fixed reply,
0.2 + 0.4 x (share of the commonest first digit) + 0.4 x (share of the commonest second digit).
The dataset (examples/data/demo.jsonl) holds every number 10..99 exactly twice, so those shares
are 1/9 and 1/10 and the ceiling is 0.2 + 0.4/9 + 0.4/10 = 0.284 (tests/unit/test_demo_task.py
computes it from the file). Everything above 0.284 comes from reading the number in the prompt.

The tiny model `arl demo` trains was warm-started only on the answer format (pipeline/demo/warm_start.py,
examples/data/demo_format.jsonl: prompts that name no number, random two-digit replies), so
before RL it answers a random two-digit number (exact-correct ~1/90); copying is learned by RL.
"""

from __future__ import annotations

from typing import Any

import httpx
from openai import AsyncOpenAI

SYSTEM_PROMPT = ""
"""Empty, and the user's message is short, on purpose: the tiny model learns to copy by finding, with one attention
head, the digit 7 tokens back, and every prompt token it could attend to instead dilutes that signal. With
Qwen's template an empty system message is 5 tokens (no message at all would bring in Qwen's default one);
the whole prompt is 24 tokens. With "Answer with digits only." and "Repeat the number 59." (42 tokens), RL found
the copy within the demo's 150 steps on 3 of 8 runs (the others stayed at about one digit right); with this
prompt and examples/demo.yaml as shipped, on every run so far (benchmarks/demo_learning.py checks three seeds)."""


def user_prompt(number: str) -> str:
    """The user's message for `number` (also what benchmarks send, so they pose the same task)."""
    return f"Repeat {number}."


def score(reply: str, number: str) -> float:
    """0.2 x [exactly two digits] + 0.4 x [first digit right] + 0.4 x [second digit right] (see the module doc)."""
    text = reply.strip()
    two_digits = len(text) == 2 and text.isdigit()
    return 0.2 * two_digits + 0.4 * (text[:1] == number[:1]) + 0.4 * (text[1:2] == number[1:2])


def exact_correct(reply: str, number: str) -> bool:
    """The reply is the number itself (surrounding whitespace aside)."""
    return reply.strip() == number


class DemoAgent:
    """`run` is all arl needs: it gets an OpenAI-compatible endpoint and returns a reward (here with a metric)."""

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
    ) -> tuple[float, dict[str, float]]:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        number = str(data["number"])
        completion = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(number)}],
            max_tokens=self.max_tokens,
            temperature=temperature,
        )
        reply = completion.choices[0].message.content or ""
        # (reward, metrics): arl averages each metric per step as `agent/<name>` in metrics/rollout.jsonl
        return score(reply, number), {"exact_correct": float(exact_correct(reply, number))}
