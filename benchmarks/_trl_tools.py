"""TRL's GRPOTrainer on `arl demo --task tools`: one seed, one process (run by benchmarks/vs_trl_tools.py).

Usage: python benchmarks/_trl_tools.py SPEC.json RESULT.json

The parent builds SPEC with `capture_tool_prompts` and `tool_spec` (light imports, no TRL): the prompts of arl's
schedule as the task's agent sends them (its first request, captured in-process), the tool schema that request
carries, the agent's turn limits and the `trl.GRPOConfig` options. This process then trains with TRL's own
multi-turn loop, given the tool as a plain function (`tools=[calculator]`, see `make_calculator`): it calls the
task's own `calculate`, and the reward function calls the task's own `outcome` (its `score`, plus the metrics
exact_correct and used_tool) on the episode's final assistant message, with the truth a + b of the prompt's row.

Why a plain tool and not `environment_factory`: the calculator is stateless, so an episode needs no state of its
own; the one per-episode figure the agent keeps, its count of well-formed calls (`used_tool`), is a function of
the episode's messages, which TRL hands the reward function (`well_formed_calls`). An environment would only carry
that counter, through an API TRL 1.16 still calls experimental.

Two adjustments make TRL's episode the agent's (the parent's docstring lists what still differs):
* the tool's JSON schema: TRL renders a tool function through transformers' `get_json_schema` (signature and
  docstring), the Agents SDK sends its own strict schema (the task's `CALCULATOR_TOOL`), and the model was
  warm-started with the SDK's in its prompt. `patch_tool_schema` makes `get_json_schema` return the captured
  schema for the calculator function (and only it), in `transformers.utils.chat_template_utils` (where
  `render_jinja_template`, hence `apply_chat_template`, looks it up at call time) and in the response parser
  (which casts parsed arguments);
* parsing the model's tool calls: the tiny model's chat template is Qwen2.5's with three extensions, so TRL's
  `add_response_schema` does not recognise it; the tokenizer gets the `response_template` that helper sets for
  Qwen2.5's template (`trl.chat_template_utils.qwen3_template`: `<tool_call>` JSON blocks, content up to
  `<|im_end|>`), which is what the extensions leave unchanged.

RESULT holds, per step (one generation of batch x group episodes), every reward and when it was computed, the
means of the agent's metrics and of model calls per episode, the prompt token ids TRL generated from, the tool
spans it inserted (tool-result tokens between two model turns, keyed by the tool results' text), when each
optimizer step ended, and TRL's own log. Times are Unix times.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: they are part of TRL's whole-process time

import asyncio  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/_trl_tools.py`: the root, for `benchmarks.` imports

from benchmarks import _trl_grpo  # noqa: E402

CAPTURE_REPLY = "The answer is 0."
"""What the capture answers the agent's first request with: a final answer, so the agent makes one request."""
TOOL_SPANS_KEPT = 400
"""Distinct tool spans recorded per step (enough to meet arl's for the same tool results)."""


# --------------------------------------------------------------------------- the spec (parent process)


def capture_tool_prompts(config: Any, steps: int) -> list[dict[str, Any]]:
    """Per scheduled prompt of steps 0..steps-1, in arl's schedule order: the row and the agent's first request
    (messages, tools, max_tokens, temperature), as the agent sends it to arl's proxy."""
    from pipeline.agents.dataset import Schedule, load_rows
    from pipeline.agents.loading import resolve_agent

    rollout = config.rollout
    agent = resolve_agent(rollout.agent, rollout.agent_kwargs, mode=rollout.mode)
    schedule = Schedule(load_rows(rollout.dataset), rollout.batch_size, shuffle=rollout.dataset.shuffle,
                        seed=rollout.dataset.seed)  # fmt: skip
    out = []
    for step in range(steps):
        for prompt in schedule.prompts(step):
            request = _first_request(agent, dict(prompt.data), rollout.temperature)
            out.append({"step": step, "data": dict(prompt.data), "messages": request["messages"],
                        "tools": request.get("tools") or [], "max_tokens": request.get("max_tokens"),
                        "temperature": request.get("temperature")})  # fmt: skip
    return out


def _first_request(agent: Any, data: dict[str, Any], temperature: float) -> dict[str, Any]:
    import httpx

    from benchmarks._trl_align import _run_agent, completion_json

    requests: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        return httpx.Response(200, json=completion_json(requests[-1].get("model", "arl-policy"), CAPTURE_REPLY))

    asyncio.run(_run_agent(agent, data, answer, temperature))
    if len(requests) != 1 or "messages" not in requests[0]:
        raise SystemExit(f"vs_trl_tools: the agent made {len(requests)} requests for a final answer; expected 1")
    return requests[0]


def tool_spec(
    config: Any, calls: list[dict[str, Any]], *, seed: int, output_dir: str, model_path: str
) -> dict[str, Any]:
    """What this process reads: the model, prompts, tool schema, turn limits and `GRPOConfig` options."""
    from benchmarks._trl_align import grpo_config_kwargs
    from pipeline.agents.loading import resolve_agent

    rollout = config.rollout
    agent = resolve_agent(rollout.agent, rollout.agent_kwargs, mode=rollout.mode).obj
    schemas = {json.dumps(c["tools"], sort_keys=True) for c in calls}
    asked = {c["max_tokens"] for c in calls}
    if len(schemas) != 1 or len(asked) != 1:
        raise SystemExit("vs_trl_tools: the agent sends different tools or max_tokens per prompt")
    (per_turn,) = asked
    per_turn = config.proxy.max_tokens_limit if per_turn is None else min(int(per_turn), config.proxy.max_tokens_limit)
    options = grpo_config_kwargs(config, max_tokens=per_turn, seed=seed, output_dir=output_dir)
    # The agent's loop: at most `max_turns` model calls, so at most max_turns - 1 rounds of tool results; each
    # model call samples at most `per_turn` tokens (arl's proxy caps each call; TRL's generation config each
    # generate call). `max_completion_length`, TRL's budget for the whole episode after the prompt, is set in the
    # training process to what arl's context leaves (model.max_context less the prompt).
    options["max_tool_calling_iterations"] = int(agent.max_turns) - 1
    options["generation_kwargs"] = {"max_new_tokens": per_turn}
    return {"model_path": model_path, "max_context": config.model.max_context, "trl_kwargs": options,
            "agent": rollout.agent, "agent_kwargs": rollout.agent_kwargs, "agent_mode": rollout.mode,
            "tools": calls[0]["tools"], "prompts": calls}  # fmt: skip


# --------------------------------------------------------------------------- the episode (this process)


TOOL_NAME = "calculator"
"""The tool's name, as the agent's `function_tool` and `CALCULATOR_TOOL` give it."""


def make_calculator(calculate: Callable[[str], str], refusal: str) -> Callable[..., str]:
    """The agent's `calculator` tool as a plain function for TRL (which keys tools by `__name__`)."""

    def calculator(expression: Any = None, **_ignored: Any) -> str:
        # The SDK validates the arguments with its pydantic model before calling the tool (other keys ignored;
        # a missing or non-string `expression` fails) and answers a failure with its fixed refusal; so does this.
        if not isinstance(expression, str):
            return refusal
        return calculate(expression)

    return calculator


def well_formed_calls(messages: list[dict[str, Any]]) -> int:
    """The agent's `good_calls` for an episode: the model's calculator calls whose arguments the SDK accepts (an
    object with a string `expression`), the last turn's included (the SDK runs its tool before it stops)."""
    return sum(1 for call in _tool_calls(messages) if call.get("name") == TOOL_NAME and _has_expression(call))


def _has_expression(call: dict[str, Any]) -> bool:
    arguments = call.get("arguments")
    return isinstance(arguments, dict) and isinstance(arguments.get("expression"), str)


def _tool_calls(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    yield call["function"]


def patch_tool_schema(schema: dict[str, Any], tool: Callable[..., Any]) -> None:
    """`get_json_schema` returns `schema` for `tool`, transformers' own result otherwise."""
    from transformers.utils import chat_template_utils
    from transformers.utils.chat_parsing import response_parser

    original = chat_template_utils.get_json_schema

    def get_json_schema(func: Callable[..., Any]) -> dict[str, Any]:
        if func is tool:
            return copy.deepcopy(schema)
        return original(func)

    chat_template_utils.get_json_schema = get_json_schema
    response_parser.get_json_schema = get_json_schema


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The agent's final output: the last message's text when it is the model's and calls no tool, else ""
    (the turns ran out on a tool call, as the SDK's MaxTurnsExceeded, or the last turn was cut off)."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return ""
    return str(last.get("content") or "")


class Record(_trl_grpo.Record):
    """`_trl_grpo`'s record of a run, plus the tool spans TRL inserted per step."""

    def __init__(self) -> None:
        super().__init__()
        self.tool_spans: list[dict[str, list[int]]] = []


def make_reward(spec: dict[str, Any], namespace: dict[str, Any], record: Record) -> Callable[..., list[float]]:
    """TRL's reward function: the task's own `outcome` (score and metrics) of each episode's final answer, against
    the truth a + b of the episode's row, with the episode's well-formed calculator calls as the agent counts them."""
    outcome = namespace["outcome"]
    truths = [int(p["data"]["a"]) + int(p["data"]["b"]) for p in spec["prompts"]]

    def reward(completions: list[Any], prompt_index: list[int], **_: Any) -> list[float]:
        results = [outcome(final_answer(c), truths[i], well_formed_calls(c))
                   for c, i in zip(completions, prompt_index, strict=True)]  # fmt: skip
        rewards = [float(r) for r, _ in results]
        infos = [{**{k: float(v) for k, v in m.items()}, "turns_mean": float(_model_turns(c))}
                 for (_, m), c in zip(results, completions, strict=True)]  # fmt: skip
        record.rewards.append(rewards)
        record.reward_times.append(time.time())
        record.info.append({k: sum(i.get(k, 0.0) for i in infos) / len(infos) for k in set().union(*infos)})
        return rewards

    return reward


def _model_turns(messages: list[dict[str, Any]]) -> int:
    return sum(m.get("role") == "assistant" for m in messages)


def tool_spans(
    completion_ids: list[list[int]], tool_mask: list[list[int]], completions: list[Any]
) -> dict[str, list[int]]:
    """{tool results' text (joined by a NUL when one turn called several): the token ids TRL put between the
    two model turns}, over a generation's episodes."""
    out: dict[str, list[int]] = {}
    for ids, mask, messages in zip(completion_ids, tool_mask, completions, strict=True):
        spans, start = [], None
        for k, m in enumerate([*mask, 1]):
            if m == 0 and start is None:
                start = k
            elif m == 1 and start is not None:
                spans.append(list(map(int, ids[start:k])))
                start = None
        groups, current = [], []
        for message in messages:
            if message.get("role") == "tool":
                current.append(str(message["content"]))
            elif current:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
        for span, texts in zip(spans, groups, strict=False):
            if len(out) < TOOL_SPANS_KEPT:
                out.setdefault("\0".join(texts), span)
    return out


# --------------------------------------------------------------------------- the training (this process)


def build_trainer(spec: dict[str, Any], record: Record) -> tuple[Any, dict[str, Any]]:
    """TRL's trainer on the spec, and what was checked while building it."""
    import torch
    from agents.tool import default_tool_error_function
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template, supports_tool_calling

    from benchmarks._trl_align import agent_namespace
    from pipeline.agents.loading import resolve_agent

    namespace = agent_namespace(resolve_agent(spec["agent"], spec["agent_kwargs"], mode=spec["agent_mode"]))
    (schema,) = spec["tools"]
    refusal = default_tool_error_function(None, ValueError("arguments do not match the tool's schema"))  # type: ignore[arg-type]
    calculator = make_calculator(namespace["calculate"], refusal)
    patch_tool_schema(schema, calculator)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    checks = {"supports_tool_calling": supports_tool_calling(tokenizer),
              "response_template_before": getattr(tokenizer, "response_template", None) is not None}  # fmt: skip
    tokenizer.response_template = qwen3_template
    longest = max(len(_render(tokenizer, p["messages"], calculator)) for p in spec["prompts"])
    options = {**spec["trl_kwargs"], "max_completion_length": spec["max_context"] - longest}
    checks["max_completion_length"] = options["max_completion_length"]
    trainer_class = _recording_trainer(GRPOTrainer, record)

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.step_ends.append(time.time())

    rows = [{"prompt": p["messages"], "prompt_index": i, **p["data"]} for i, p in enumerate(spec["prompts"])]
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    trainer = trainer_class(model=model, reward_funcs=make_reward(spec, namespace, record),
                            args=GRPOConfig(**options), train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, tools=[calculator],
                            callbacks=[StepEnds()])  # fmt: skip
    checks["chat_template_replaced_by_trl"] = trainer.chat_template is not None
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": TOOL_NAME, "content": "731"}])
    checks["tool_suffix_example"] = suffix
    return trainer, checks


def _render(tokenizer: Any, messages: list[dict[str, Any]], tool: Callable[..., str]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


def _recording_trainer(base: type, record: Record) -> type:
    """`base` recording the prompt ids TRL really generates from and the tool spans it inserts."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def _tokenize_prompts(self, prompts: list[Any]) -> Any:
            out = super()._tokenize_prompts(prompts)
            record.prompt_ids.append([list(map(int, ids)) for ids in out[0]])
            return out

        def _tool_call_loop(self, prompts: Any, prompt_ids: Any, completion_ids: Any, completions: Any,
                            *rest: Any) -> Any:  # fmt: skip
            out = super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, *rest)
            tool_mask, completions_out, completion_ids_out = out[0], out[1], out[2]
            record.tool_spans.append(tool_spans(completion_ids_out, tool_mask, completions_out))
            return out

    return Recording


def main() -> int:
    spec_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    record = Record()
    trainer, checks = build_trainer(spec, record)
    begin = time.time()
    trainer.train()
    end = time.time()
    result = {"started": STARTED, "train_begin": begin, "train_end": end, "rewards": record.rewards,
              "reward_times": record.reward_times, "info": record.info, "step_ends": record.step_ends,
              "prompt_ids": record.prompt_ids, "tool_spans": record.tool_spans, "checks": checks,
              "log": trainer.state.log_history}  # fmt: skip
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
