"""A multi-turn tool-calling agent written against the plain OpenAI SDK (no arl code in it).

The model may call a `calculator` tool; the agent evaluates the expression, appends the assistant
message exactly as returned plus the tool result, and calls the model again, until the model
answers without a tool call or `max_turns` is reached. Because every later request extends the
earlier one, the proxy records the whole run token-exactly (one concat row per run).

Reward: 1.0 when the final answer contains the expected number, plus 0.1 per well-formed tool
call (capped at 0.2), so that a small model learns to use the tool before it learns to be right.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

import httpx
from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 3) * 4"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculate(expression: str) -> str:
    """Evaluate arithmetic safely (no names, no calls): the model's text is untrusted input."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))  # type: ignore[operator]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))  # type: ignore[operator]
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if value.is_integer() else f"{value:.6g}"


def run_tool_call(call: Any) -> tuple[str, bool]:
    """(tool result text, whether the call was well-formed)."""
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}", False
    try:
        arguments = json.loads(call.function.arguments or "{}")
        expression = str(arguments["expression"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: arguments must be a JSON object with an `expression` string", False
    return calculate(expression), True


class ToolAgent:
    required_fields = ("question", "answer")

    def __init__(self, max_turns: int = 3, max_tokens: int = 48, model: str = "arl-policy") -> None:
        self.max_turns = max_turns
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
        # openai>=3 is typed for httpx2 clients but accepts the httpx one the rollout passes.
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        messages: list[Any] = [
            {"role": "system", "content": "Use the calculator tool for arithmetic, then give the number."},
            {"role": "user", "content": data["question"]},
        ]
        good_calls = 0
        answer = ""
        for _turn in range(self.max_turns):
            completion = await client.chat.completions.create(
                model=self.model, messages=messages, tools=[CALCULATOR],  # type: ignore[list-item]
                max_tokens=self.max_tokens, temperature=temperature,
            )  # fmt: skip
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                result, ok = run_tool_call(call)
                good_calls += ok
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        correct = str(data["answer"]) in answer
        return float(correct) + 0.1 * min(good_calls, 2)
