"""TRL's GRPOTrainer on the arl demo's experiment: one seed, one process (run by benchmarks/vs_trl.py).

Usage: python benchmarks/_trl_grpo.py SPEC.json RESULT.json
SPEC is written by `_trl_align.spec_json` (model, prompts in arl's schedule order, reward route, GRPOConfig
options). RESULT holds, per step, every reward and when it was computed, when each optimizer step ended,
the prompt token ids TRL generated from (to check they are arl's), and TRL's own log. Times are Unix
times, so the parent can relate them to when it started this process.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: they are part of TRL's whole-process time

import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/_trl_grpo.py`: the root, for `benchmarks.` imports


class Record:
    """What the run produced, filled in by the reward function, the callback and the trainer subclass."""

    def __init__(self) -> None:
        self.rewards: list[list[float]] = []
        self.reward_times: list[float] = []
        self.info: list[dict[str, float]] = []
        self.step_ends: list[float] = []
        self.prompt_ids: list[list[list[int]]] = []


def make_reward(spec: dict[str, Any], record: Record) -> Any:
    """TRL's reward function: the demo's own scoring, by the route `_trl_align.capture_prompts` chose."""
    prompts = spec["prompts"]
    score = _score_function(spec) if spec["route"] == "score" else None
    agent = None if score else _agent(spec)

    def reward(completions: list[Any], prompt_index: list[int], **_: Any) -> list[float]:
        replies = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
        if score is not None:
            results = [score(reply, *prompts[i]["score_args"], **prompts[i]["score_kwargs"])
                       for reply, i in zip(replies, prompt_index, strict=True)]  # fmt: skip
        else:
            results = asyncio.run(_agent_rewards(agent, [prompts[i]["data"] for i in prompt_index], replies, spec))
        rewards, infos = zip(*(_split(r) for r in results), strict=True)
        record.rewards.append([float(r) for r in rewards])
        record.reward_times.append(time.time())
        record.info.append({k: sum(i.get(k, 0.0) for i in infos) / len(infos) for k in set().union(*infos)})
        return [float(r) for r in rewards]

    return reward


def _split(result: Any) -> tuple[float, dict[str, float]]:
    """A score's `reward` or `(reward, {name: number})`."""
    if isinstance(result, tuple):
        reward, info = result
        return float(reward), {k: float(v) for k, v in dict(info).items() if isinstance(v, int | float)}
    if isinstance(result, int | float):
        return float(result), {}
    raise TypeError(f"the demo's reward is {result!r}; vs_trl understands a number or (number, dict)")


def _score_function(spec: dict[str, Any]) -> Any:
    from benchmarks._trl_align import agent_namespace

    return agent_namespace(_agent(spec))["score"]


def _agent(spec: dict[str, Any]) -> Any:
    from pipeline.agents.loading import resolve_agent

    return resolve_agent(spec["agent"], spec["agent_kwargs"], mode=spec["agent_mode"])


async def _agent_rewards(agent: Any, rows: list[dict[str, Any]], replies: list[str], spec: dict[str, Any]) -> list[Any]:
    """Run the agent once per completion, its one request answered with TRL's completion."""
    import httpx

    from benchmarks._trl_align import FAKE_BASE_URL, completion_json

    async def one(row: dict[str, Any], reply: str) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json=completion_json("arl-policy", reply))

        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            offered = {"base_url": FAKE_BASE_URL, "api_key": "vs-trl", "http_client": client,
                       "temperature": spec["trl_kwargs"]["temperature"]}  # fmt: skip
            return await agent.obj.run(row, **agent.run_kwargs(offered))

    return await asyncio.gather(*(one(row, reply) for row, reply in zip(rows, replies, strict=True)))


def train(spec: dict[str, Any], record: Record) -> tuple[float, float, list[dict[str, Any]]]:
    """Build the trainer and train; returns (train start, train end, TRL's log history)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Recording(GRPOTrainer):  # records the prompt ids TRL really generates from
        def _tokenize_prompts(self, prompts: list[Any]) -> Any:
            out = super()._tokenize_prompts(prompts)
            record.prompt_ids.append([list(map(int, ids)) for ids in out[0]])
            return out

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.step_ends.append(time.time())

    rows = [{"prompt": p["messages"], "prompt_index": i} for i, p in enumerate(spec["prompts"])]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    trainer = Recording(model=model, reward_funcs=make_reward(spec, record),
                        args=GRPOConfig(**spec["trl_kwargs"]), train_dataset=Dataset.from_list(rows),
                        processing_class=tokenizer, callbacks=[StepEnds()])  # fmt: skip
    begin = time.time()
    trainer.train()
    return begin, time.time(), trainer.state.log_history


def main() -> int:
    spec_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    record = Record()
    begin, end, log = train(spec, record)
    result = {"started": STARTED, "train_begin": begin, "train_end": end, "rewards": record.rewards,
              "reward_times": record.reward_times, "info": record.info, "step_ends": record.step_ends,
              "prompt_ids": record.prompt_ids, "log": log}  # fmt: skip
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
