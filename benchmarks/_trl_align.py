"""What TRL's GRPOTrainer must be given to run the arl demo's experiment (used by benchmarks/vs_trl.py).

Two things are derived from the arl config rather than written down, so the comparison follows the demo
as it changes:

* `capture_prompts`: the prompts of every step, in arl's schedule order (`pipeline.agents.dataset.Schedule`),
  as the demo agent itself writes them. The agent's own `run` is executed once per prompt with an
  `httpx` transport that answers its one chat-completions request in-process, so the messages,
  `max_tokens` and `temperature` are what the agent sends to arl's proxy. While it runs, the module-level
  `score` function the agent calls (if any) is wrapped to record its arguments: TRL's reward function can
  then call `score(reply, *same_args)` directly, as a TRL user would, instead of paying for an OpenAI
  client per completion. When `run` returns neither `score`'s result unchanged nor `(that result, metrics)`,
  TRL goes through the agent's `run` instead (`route = "agent"`), which is slower but always the same reward.
* `grpo_config_kwargs`: the `trl.GRPOConfig` keyword arguments equivalent to the arl config
  (docs/trainer.md, "arl vs TRL's GRPO", explains each one, checked against TRL 1.16's source).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pipeline.agents.dataset import Schedule, load_rows
from pipeline.agents.loading import Agent, resolve_agent
from schemas.config import ArlConfig

SENTINEL_REPLY = "vs-trl-capture-reply"
"""What the capture answers the agent's request with: the first argument `score` must then receive."""
FAKE_BASE_URL = "http://vs-trl.invalid/v1"


@dataclass
class PromptCall:
    """One scheduled prompt as the agent sends it, and how to score a reply to it."""

    step: int
    data: dict[str, Any]
    messages: list[dict[str, Any]]
    max_tokens: int | None
    temperature: float | None
    score_args: list[Any] | None = None
    """Arguments of `score` after the reply (None: `score` was not called with the reply first)."""
    score_kwargs: dict[str, Any] = field(default_factory=dict)
    direct: bool = False
    """True when `run` returned `score`'s result unchanged, so calling `score` is the same reward."""


def capture_prompts(config: ArlConfig, steps: int) -> tuple[list[PromptCall], str]:
    """The prompts of steps 0..steps-1 in schedule order, and the reward route TRL can take
    (`score`: call the agent module's `score` directly; `agent`: run the agent for every completion)."""
    rollout = config.rollout
    agent = resolve_agent(rollout.agent, rollout.agent_kwargs, mode=rollout.mode)
    if agent.kind != "run":
        raise SystemExit(f"vs_trl: the agent {rollout.agent} is a workflow; only `run` agents can be replayed in TRL")
    schedule = Schedule(load_rows(rollout.dataset), rollout.batch_size, shuffle=rollout.dataset.shuffle,
                        seed=rollout.dataset.seed)  # fmt: skip
    calls = [_capture_one(agent, prompt.data, step, rollout.temperature)
             for step in range(steps) for prompt in schedule.prompts(step)]  # fmt: skip
    direct = all(c.direct and _json_safe(c.score_args, c.score_kwargs) for c in calls)
    return calls, "score" if direct else "agent"


def _capture_one(agent: Agent, data: dict[str, Any], step: int, temperature: float) -> PromptCall:
    requests: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        return httpx.Response(200, json=completion_json(body.get("model", "arl-policy"), SENTINEL_REPLY))

    recorded: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
    namespace = agent_namespace(agent)
    original = namespace.get("score")
    if callable(original):

        def recording_score(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            recorded.append((args, kwargs, result))
            return result

        namespace["score"] = recording_score
    try:
        returned = asyncio.run(_run_agent(agent, data, answer, temperature))
    finally:
        if callable(original):
            namespace["score"] = original
    if len(requests) != 1 or "messages" not in requests[0]:
        raise SystemExit(f"vs_trl: the agent made {len(requests)} chat-completions requests for one prompt; "
                         "TRL's GRPOTrainer replays single-turn OpenAI chat agents only")  # fmt: skip
    request = requests[0]
    call = PromptCall(step, dict(data), request["messages"], request.get("max_tokens"), request.get("temperature"))
    if len(recorded) == 1 and recorded[0][0][:1] == (SENTINEL_REPLY,):
        args, kwargs, result = recorded[0]
        call.score_args, call.score_kwargs = list(args[1:]), dict(kwargs)
        # The agent may return score's result itself, or (score's result, {metrics}): either way calling `score`
        # is the same reward. The metrics are then not computed for TRL (running the agent per completion costs
        # TRL ~1 s a step at 512 completions, time arl does not charge it), so TRL's runs report the reward only.
        reward_of_score = result[0] if isinstance(result, tuple) else result
        first = returned[0] if isinstance(returned, tuple) and len(returned) == 2 else None
        call.direct = returned is result or returned is reward_of_score or first is reward_of_score
    return call


def agent_namespace(agent: Agent) -> dict[str, Any]:
    """The globals of the module defining the agent's `run` (where its `score` lives); empty when `run` is not a
    plain method."""
    run = agent.obj.run
    return run.__func__.__globals__ if hasattr(run, "__func__") else {}


async def _run_agent(agent: Agent, data: dict[str, Any], answer: Any, temperature: float) -> Any:
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        offered = {"base_url": FAKE_BASE_URL, "anthropic_base_url": FAKE_BASE_URL.removesuffix("/v1"),
                   "api_key": "vs-trl", "http_client": client, "temperature": temperature}  # fmt: skip
        return await agent.obj.run(data, **agent.run_kwargs(offered))


def completion_json(model: str, content: str) -> dict[str, Any]:
    """An OpenAI chat-completions response body holding `content` (what the agent's SDK parses)."""
    return {"id": "chatcmpl-vs-trl", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}  # fmt: skip


def _json_safe(*values: Any) -> bool:
    try:
        json.dumps(values)
    except (TypeError, ValueError):
        return False
    return True


def max_completion_tokens(config: ArlConfig, calls: list[PromptCall]) -> int:
    """The agent's `max_tokens` (one value for every prompt), capped by the proxy as arl caps it."""
    asked = {c.max_tokens for c in calls}
    if len(asked) != 1:
        raise SystemExit(f"vs_trl: the agent asks for different max_tokens per prompt ({sorted(map(str, asked))}); "
                         "TRL has one max_completion_length")  # fmt: skip
    (value,) = asked
    limit = config.proxy.max_tokens_limit
    return limit if value is None else min(int(value), limit)


def grpo_config_kwargs(config: ArlConfig, *, max_tokens: int, seed: int, output_dir: str) -> dict[str, Any]:
    """`trl.GRPOConfig(**kwargs)` equivalent to `config` (docs/trainer.md, "arl vs TRL's GRPO")."""
    alg, opt, rollout = config.trainer.algorithm, config.trainer.optimizer, config.rollout
    if alg.advantage == "rloo":
        raise SystemExit("vs_trl: trainer.algorithm.advantage=rloo has no GRPOTrainer equivalent (TRL's RLOOTrainer)")
    samples, minibatches = rollout.batch_size * rollout.group_size, config.trainer.minibatches
    if samples % minibatches:
        raise SystemExit(f"vs_trl: {samples} samples per step do not split into {minibatches} equal minibatches")
    return {
        "output_dir": output_dir, "seed": seed, "use_cpu": config.trainer.device == "cpu",
        # One generation of batch_size prompts x group_size completions per arl step; its minibatches are
        # TRL's steps_per_generation (TRL then recomputes the old log-probs, as arl's proximal ones).
        "max_steps": config.num_steps * minibatches, "per_device_train_batch_size": samples // minibatches,
        "gradient_accumulation_steps": 1, "steps_per_generation": minibatches, "num_iterations": 1,
        "num_generations": rollout.group_size, "shuffle_dataset": False,  # the dataset is in arl's schedule order
        "temperature": rollout.temperature, "top_p": 1.0, "top_k": 0, "max_completion_length": max_tokens,
        "mask_truncated_completions": False, "importance_sampling_level": "token",
        "learning_rate": opt.lr, "optim": "adamw_torch", "adam_beta1": opt.betas[0], "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps, "weight_decay": opt.weight_decay, "max_grad_norm": opt.grad_clip,
        "warmup_steps": opt.warmup_steps, **_schedule(opt.schedule, opt.min_lr_ratio, opt.warmup_steps),
        "epsilon": alg.clip_eps, "epsilon_high": alg.clip_eps_high or alg.clip_eps,
        "beta": alg.kl_coef, "use_bias_correction_kl": False,  # arl's k3 term is not multiplied by the ratio
        "entropy_coef": alg.entropy_coef,
        "loss_type": "dapo" if alg.loss_agg == "token" else "grpo",
        "scale_rewards": "group" if alg.advantage == "grpo" else "none",
        # arl trains in model.dtype on CPU with no autocast and no checkpointing unless asked (TRL: bf16 and
        # gradient checkpointing on by default).
        "bf16": False, "fp16": False, "gradient_checkpointing": config.trainer.gradient_checkpointing,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "disable_tqdm": True,
        "dataloader_num_workers": 0, "remove_unused_columns": False,
    }  # fmt: skip


def _schedule(schedule: str, min_lr_ratio: float, warmup: int) -> dict[str, Any]:
    if schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if warmup else "constant"}
    if schedule == "linear" and min_lr_ratio == 0:
        return {"lr_scheduler_type": "linear"}
    if schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": min_lr_ratio}}
    raise SystemExit(f"vs_trl: schedule {schedule} with min_lr_ratio {min_lr_ratio} has no transformers equivalent")


def spec_json(calls: list[PromptCall], route: str, config: ArlConfig, trl_kwargs: dict[str, Any],
              model_path: str) -> dict[str, Any]:  # fmt: skip
    """What benchmarks/_trl_grpo.py reads: the model, the prompts in order, the reward route and the options."""
    return {
        "model_path": model_path, "route": route, "trl_kwargs": trl_kwargs,
        "agent": config.rollout.agent, "agent_kwargs": config.rollout.agent_kwargs, "agent_mode": config.rollout.mode,
        "prompts": [asdict(c) for c in calls],
    }  # fmt: skip


def rescore_shards(run_dir: Path, steps: int) -> tuple[int, list[str]] | None:
    """Every sample of an arl run's first `steps` shards scored the way TRL's reward function scores a completion:
    TRL's decoding of the completion ids (`batch_decode(..., skip_special_tokens=True)`) given to the agent's `score`
    with the arguments the agent passed it for that prompt. Returns (samples checked, a description of each sample
    whose reward differs from the one arl recorded), or None when the agent's reward is not `score`'s."""
    from transformers import AutoTokenizer

    from pipeline.run.config import config_from_run_dir
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step

    config = config_from_run_dir(run_dir)
    rollout = config.rollout
    agent = resolve_agent(rollout.agent, rollout.agent_kwargs, mode=rollout.mode)
    score = agent_namespace(agent).get("score")
    if not callable(score):
        return None
    rows, calls, paths = load_rows(rollout.dataset), {}, RunPaths(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    checked, differing = 0, []
    for step in range(steps):
        table = read_step(paths, step, verify=False,
                          columns=["input_ids", "prompt_len", "reward", "metadata"]).to_pylist()  # fmt: skip
        for row in table:
            index = int(json.loads(row["metadata"])["dataset_index"])
            if index not in calls:
                calls[index] = _capture_one(agent, rows[index], step, rollout.temperature)
            call = calls[index]
            if not call.direct or call.score_args is None:
                return None
            text = tokenizer.decode(row["input_ids"][row["prompt_len"] :], skip_special_tokens=True)
            result = score(text, *call.score_args, **call.score_kwargs)
            reward = float(result[0] if isinstance(result, tuple) else result)
            checked += 1
            if abs(reward - row["reward"]) > 1e-6:  # the shard stores float32
                differing.append(f"step {step} {text!r}: TRL's way {reward}, arl {row['reward']}")
    return checked, differing
