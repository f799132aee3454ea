"""`arl demo --task tools`: an unmodified OpenAI Agents SDK agent that must use a calculator tool.

Task: "What is 673 + 58?" (a three-digit and a two-digit number, so every sum has three digits). A tiny
model cannot add, so the way to the answer is the agent's `calculator` tool: the model calls it with the
question's expression (turn 1), reads its result, and answers with it (turn 2). `score` grades the final answer only:

    1.0                                    if it is the right number
    0.5 x max(0, 1 - |answer - truth| / 100)  if it is another number (nearer is better)
    0.0                                    if it is not a number

The closeness term is what lets RL start: before RL the model calls the tool with numbers of its
own, so no answer is right, but a call that has the first number's hundreds digit right lands within
~100 of the truth and scores higher. It does not reward ignoring the question: the sums are spread
evenly over 110..998, so one fixed call scores about what a random one does (~0.06, see
tests/unit/test_tools_task.py), and only reading the question pays. Only the final answer is scored,
so the reward reaches the tool call's tokens (turn 1) through the result they produced: credit
across turns.

The tiny model `arl demo --task tools` trains was warm-started on the *protocol* only
(examples/data/tools_format.jsonl, see `format_rows`): questions like the above, tool calls with
numbers drawn independently of the question, the tool's result for those numbers, and a final
answer that repeats the result. So before RL it calls the tool well-formed and reports what the tool
said, but the numbers it asks about are its own: every warm-start answer is wrong for its question,
and the exact-correct rate before RL is ~0. Reading the question's numbers into the call is left
entirely to RL.

Two agents pose the same task: `ToolsAgent`, written against the OpenAI Agents SDK (a
`function_tool` and the SDK's own runner loop; the demo's), and `PlainToolsAgent`, the same loop
written by hand against the plain OpenAI SDK (`arl launch examples/tools.yaml
rollout.agent=examples/tools_agent.py:PlainToolsAgent`). Both report the metrics `exact_correct` (the final
answer is right) and `used_tool` (at least one well-formed calculator call). Neither contains any arl code.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

import httpx
from openai import AsyncOpenAI

INSTRUCTIONS = "Use the calculator."
"""The system message. Short on purpose: the tiny model finds the question's numbers by attention, and every
prompt token is a place it could look instead (the tool's schema, which the chat template renders into
the system message, is already ~300 tokens)."""
TOOL_DESCRIPTION = "Evaluate an arithmetic expression."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}
_ANSWER = re.compile(r"(?:The answer is )?(-?\d+)\.?")
FIRST, SECOND = (100, 899), (10, 99)
"""The operands' ranges. Every sum then has three digits, and every question and call the same number of tokens,
so what the model copies sits at a fixed distance from where it writes it: a one-layer model can learn that."""


def question(a: int, b: int) -> str:
    """The user's message for a + b (also what the warm start and benchmarks pose)."""
    return f"What is {a} + {b}?"


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic safely (no names, no calls: the model's text is untrusted input)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))  # type: ignore[operator]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))  # type: ignore[operator]
        raise ValueError(f"unsupported element {type(node).__name__}")

    if len(expression) > 64:
        return "error: expression too long"
    try:
        return str(walk(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


def parse_answer(text: str) -> int | None:
    """The final answer's number: the reply (stripped) must be "The answer is N." or N alone, nothing else."""
    found = _ANSWER.fullmatch(text.strip())
    return int(found.group(1)) if found else None


def answer_text(value: str) -> str:
    """How the warm start's answers are written. Not the bare number: in a one-layer model the query of the token
    before the answer's first digit is that token's own; the bare number would put it on the newline that ends
    every turn header, " is" exists only here, so repeating the tool's result is a copy at a fixed distance."""
    return f"The answer is {value}."


def score(answer: str, truth: int) -> float:
    """The task's grade of a final answer (see the module doc)."""
    value = parse_answer(answer)
    if value is None:
        return 0.0
    if value == truth:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(value - truth) / 100)


def outcome(answer: str, truth: int, good_calls: int) -> tuple[float, dict[str, float]]:
    """(reward, metrics) as arl takes them from an agent's `run`."""
    return score(answer, truth), {
        "exact_correct": float(parse_answer(answer) == truth),
        "used_tool": float(good_calls > 0),
    }


class _Settings:
    """What both agents are constructed with (`rollout.agent_kwargs`)."""

    required_fields = ("a", "b")
    """Dataset fields `run` reads (`arl check` checks the dataset has them)."""

    def __init__(self, max_turns: int = 3, max_tokens: int = 40, model: str = "arl-policy") -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.model = model


class ToolsAgent(_Settings):
    """The task's agent on the OpenAI Agents SDK: the SDK runs the loop (call model, run tool, call again)."""

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
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
        from agents.exceptions import MaxTurnsExceeded

        good_calls = 0

        @function_tool(name_override="calculator", description_override=TOOL_DESCRIPTION)
        def calculator(expression: str) -> str:
            nonlocal good_calls
            good_calls += 1
            return calculate(expression)

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        agent = Agent(
            name="calculator-agent",
            instructions=INSTRUCTIONS,
            tools=[calculator],
            model=OpenAIChatCompletionsModel(model=self.model, openai_client=client),
            model_settings=ModelSettings(temperature=temperature, max_tokens=self.max_tokens),
        )
        try:
            result = await Runner.run(
                agent, question(data["a"], data["b"]), max_turns=self.max_turns,
                run_config=RunConfig(tracing_disabled=True),
            )  # fmt: skip
            answer = str(result.final_output or "")
        except MaxTurnsExceeded:  # the model kept calling the tool: no final answer
            answer = ""
        return outcome(answer, int(data["a"]) + int(data["b"]), good_calls)


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": TOOL_DESCRIPTION,
        "parameters": {
            "properties": {"expression": {"title": "Expression", "type": "string"}},
            "required": ["expression"],
            "title": "calculator_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
"""The tool as the Agents SDK sends it for `ToolsAgent`'s `calculator` (its strict schema, byte for byte), so
both agents and the warm start put the same prompt before the model."""


class PlainToolsAgent(_Settings):
    """The same task and loop written by hand against the plain OpenAI SDK (no agent framework)."""

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
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        messages: list[Any] = [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": question(data["a"], data["b"])},
        ]
        good_calls, answer = 0, ""
        for _turn in range(self.max_turns):
            completion = await client.chat.completions.create(
                model=self.model, messages=messages, tools=[CALCULATOR_TOOL],  # type: ignore[list-item]
                max_tokens=self.max_tokens, temperature=temperature,
            )  # fmt: skip
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                result = _run_call(call)
                good_calls += result is not None
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result or "error: bad call"})
        return outcome(answer, int(data["a"]) + int(data["b"]), good_calls)


def _run_call(call: Any) -> str | None:
    """The calculator's result for a well-formed call, None for any other."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
        expression = arguments["expression"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if call.function.name != "calculator" or not isinstance(expression, str):
        return None
    return calculate(expression)


def format_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Warm-start rows that teach the protocol and nothing else: the call's numbers are drawn independently of
    the question's, so the tool's result and the final answer (which repeats it) are wrong for the question.

    Every other row trains only the answer turn (`reply`), without the system message and tool schema: repeating
    the tool's result is what the model takes longest to learn (at a third of a whole row's trained tokens it got
    little of the gradient, and 700 steps of whole rows did not teach it), and the copy is a fixed distance back
    from the answer, which a row of 40 tokens teaches as well as one of 400, at a tenth of the cost."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for index in range(count):
        a, x = rng.randint(*FIRST), rng.randint(*FIRST)
        b, y = rng.randint(*SECOND), rng.randint(*SECOND)
        expression, result = f"{x} + {y}", calculate(f"{x} + {y}")
        function = {"name": "calculator", "arguments": {"expression": expression}}
        turns = [
            {"role": "user", "content": question(a, b)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_0", "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": result},
        ]
        if index % 2:
            rows.append({"messages": turns, "reply": answer_text(result)})
        else:
            answer = {"role": "assistant", "content": answer_text(result)}
            system = {"role": "system", "content": INSTRUCTIONS}
            rows.append({"messages": [system, *turns, answer], "tools": [CALCULATOR_TOOL]})
    return rows


def task_rows(
    seed: int = 0, train: int = 2000, held_out: int = 100
) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """(training questions, held-out questions): disjoint sets of (a, b) pairs.
    examples/data/tools.jsonl and tools_eval.jsonl are these with the defaults."""
    pairs = [(a, b) for a in range(FIRST[0], FIRST[1] + 1) for b in range(SECOND[0], SECOND[1] + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"id": i, "a": a, "b": b} for i, (a, b) in enumerate(pairs[: train + held_out])]
    return rows[:train], rows[train:]
