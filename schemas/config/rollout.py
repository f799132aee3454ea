"""`rollout:` — the agent, its data, and how one step of trajectories is produced."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.config.base import UNSUPPORTED, Block

DEFAULT_TASK = "default"
"""The task of a run without `rollout.tasks`, and of any sample whose metadata names none."""


def task_of(metadata: Mapping[str, Any]) -> str:
    """The task a sample belongs to, from its metadata (`metadata.task`, written by the rollout)."""
    return str(metadata.get("task", DEFAULT_TASK))


class DatasetConfig(Block):
    path: str = "examples/data/demo.jsonl"
    """JSONL file, Parquet file, or a `datasets` dataset saved with `save_to_disk`."""
    split: str | None = None
    """Split name for a saved `DatasetDict`."""
    shuffle: bool = True
    """Shuffle each epoch (seeded: the same seed gives the same order, so resume is exact)."""
    seed: int = 0
    """Shuffle seed."""


class TaskConfig(Block):
    """One task of a run that trains on several (`rollout.tasks`): its agent, its prompts, its share of a step."""

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """Names the task in the shards (`metadata.task`), in `rollout.jsonl` (`task/<name>/...`) and for
    `arl inspect --task`."""
    agent: str
    """The task's agent (`module:attr` or `file.py:attr`), as `rollout.agent`."""
    agent_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Its constructor's kwargs."""
    dataset: DatasetConfig
    """Its prompts (each task keeps its own epochs, order and seed)."""
    weight: float = Field(1.0, gt=0)
    """Its share of each step's prompts, relative to the other tasks' weights."""


class RolloutConfig(Block):
    renamed_keys: ClassVar[dict[str, str]] = {
        "external": "write `rollout.source: external` for `external: true`, `rollout.source: agent` for false",
    }

    source: Literal["agent", "external"] = "agent"
    """Where trajectories come from: `agent` = the rollout stage runs `rollout.agent` over `rollout.dataset`;
    `external` = agents outside arl call a standalone proxy (`arl stage proxy`, docs/rollout.md)."""
    agent: str = "examples/demo_agent.py:DemoAgent"
    """The agent: `module:attr` or `path/to/file.py:attr` (a class, an instance, or a workflow)."""
    agent_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the agent's constructor when `agent` names a class."""
    mode: Literal["inline", "subproc"] = "inline"
    """`inline` = coroutine in the rollout process; `subproc` = a process pool (sync agents allowed)."""
    agent_transport: Literal["in_process", "http"] = "in_process"
    """How inline agents that use the offered `http_client` reach the proxy: `in_process` hands their requests to
    the proxy's app directly (no socket: about half the CPU of a call over loopback), `http` sends them over TCP.
    Requests to other URLs, and agents that make their own client, always go over the network."""
    subproc_workers: int = Field(4, ge=1)
    """Processes in the `subproc` pool."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """The prompts."""
    batch_size: int = Field(8, ge=1)
    """Prompts per step."""
    group_size: int = Field(4, ge=1)
    """Runs per prompt (a GRPO group)."""
    max_concurrency: int = Field(32, ge=1)
    """Most agent runs in flight at once."""
    run_timeout_s: float = Field(300.0, gt=0)
    """Deadline for one agent run; a run past it is cancelled and counted as an error."""
    max_staleness: int = Field(1, ge=0)
    """Step k may use weights of version >= k - max_staleness (0 = synchronous on-policy)."""
    export_style: Literal["individual", "concat"] = "concat"
    """`individual` = one row per LLM call; `concat` = one row per root-to-leaf path."""
    discount: float = Field(1.0, ge=0, le=1)
    """Reward discount over the conversation tree."""
    drop_constant_groups: bool = False
    """Drop groups whose rewards do not vary (they carry no GRPO signal)."""
    max_error_rate: float = Field(0.5, ge=0, le=1)
    """The stage fails when more than this fraction of a step's runs raise or time out."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature the rollout agent is asked to use (passed to the agent as a kwarg)."""
    wait_timeout_s: float = Field(3600.0, gt=0)
    """Deadline for waiting on the trainer's weight version."""
    tasks: list[TaskConfig] = Field(default_factory=list)
    """Several tasks in one run: each step draws its `batch_size` prompts from the tasks by weight (seeded by
    `task_seed` and the step, so resume and `--step N` stay exact); a group never mixes tasks. When set,
    `agent`, `agent_kwargs` and `dataset` are left out (they are the one-task shorthand)."""
    task_seed: int = 0
    """Seed of the draw of tasks per step."""

    @model_validator(mode="after")
    def _tasks_or_shorthand(self) -> RolloutConfig:
        if not self.tasks:
            return self
        # by value, not by the fields set: a frozen run config (`config.yaml`) holds every default
        fields = type(self).model_fields
        both = sorted(
            k
            for k in ("agent", "agent_kwargs", "dataset")
            if getattr(self, k) != fields[k].get_default(call_default_factory=True)
        )
        if both:
            raise PydanticCustomError(
                UNSUPPORTED,
                "rollout.tasks is set, and so is rollout.{keys}: give each task its own agent and "
                "dataset in rollout.tasks, or use the one-task shorthand without tasks",
                {"keys": "/".join(both)},
            )
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PydanticCustomError(UNSUPPORTED, "rollout.tasks: the names {names} are used twice", {"names": twice})
        if self.source == "external":
            raise PydanticCustomError(
                UNSUPPORTED,
                "rollout.tasks runs agents in the rollout stage, which a run "
                "with rollout.source=external does not have",
                {},
            )
        return self

    def task_list(self) -> list[TaskConfig]:
        """The run's tasks: `tasks`, or the shorthand as one task named `default`."""
        if self.tasks:
            return list(self.tasks)
        return [TaskConfig(name=DEFAULT_TASK, agent=self.agent, agent_kwargs=self.agent_kwargs, dataset=self.dataset)]
