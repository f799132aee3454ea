"""The run's configuration: one YAML file with typed sections, composed from small blocks.

`ArlConfig` is the whole file. Every field has a docstring (shown by `arl config --help-fields`
and in docs); unknown keys are errors. Loading, overrides and the frozen copy in the run
directory live in `pipeline.run.config`.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.config.base import UNSUPPORTED, Block
from schemas.config.cluster import ClusterConfig, StageResources
from schemas.config.eval import EvalConfig, EvalSetConfig
from schemas.config.inference import InferenceConfig, replica_flags
from schemas.config.metrics import MetricsConfig, WandbConfig
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig
from schemas.config.rollout import DatasetConfig, RolloutConfig, TaskConfig
from schemas.config.trainer import AlgorithmConfig, LoraConfig, MegatronConfig, OptimizerConfig, TrainerConfig

__all__ = [
    "AlgorithmConfig",
    "ArlConfig",
    "ClusterConfig",
    "DatasetConfig",
    "EvalConfig",
    "EvalSetConfig",
    "InferenceConfig",
    "LoraConfig",
    "MegatronConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ProxyConfig",
    "RolloutConfig",
    "StageResources",
    "TaskConfig",
    "TrainerConfig",
    "WandbConfig",
]


class ArlConfig(Block):
    experiment_name: str = Field("demo", pattern=r"^[A-Za-z0-9._-]+$")
    """Experiment name: the run dir is `<fileroot>/<experiment_name>/<trial_name>`."""
    trial_name: str = Field("trial0", pattern=r"^[A-Za-z0-9._-]+$")
    """Trial name within the experiment."""
    fileroot: str = "runs"
    """Shared directory (on a cluster: a file system every node mounts) holding run dirs."""
    num_steps: int = Field(10, ge=1)
    """Training steps in the run (the trainer produces versions 1..num_steps)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy's weights and tokenizer."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """Inference servers."""
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    """Capture proxy."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Agent, data and step production."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Algorithm, optimizer, checkpoints, weight publication."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Metrics sinks beyond JSONL and TensorBoard (W&B)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation sets: during the run (`every`, `at_start`) and offline (`arl eval`)."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Slurm resources per stage."""

    @model_validator(mode="after")
    def _broadcast_reaches_every_rank(self) -> ArlConfig:
        """The weight-broadcast group counts each server's tensor-parallel ranks only (SGLang refuses
        `update_weights_from_distributed` with data-parallel replicas; vLLM's pipeline/data-parallel workers
        would join at ranks past the group's size): dp/pp cannot take a broadcast."""
        if self.trainer.weight_sync == "nccl":
            for flag, value in replica_flags(self.inference.backend, self.inference.extra_args):
                raise PydanticCustomError(
                    UNSUPPORTED,
                    "inference.extra_args sets {flag} {value}, but trainer.weight_sync=nccl broadcasts to each "
                    "server's tensor-parallel ranks only (data and pipeline parallel size 1): use "
                    "trainer.weight_sync=disk, or more servers (inference.num_servers) instead of {flag}",
                    {"flag": flag, "value": value},
                )
        return self

    @model_validator(mode="after")
    def _eval_sets_name_an_agent_among_tasks(self) -> ArlConfig:
        unnamed = [s.name for s in self.eval.sets if s.agent is None]
        if self.rollout.tasks and unnamed:
            raise PydanticCustomError(
                UNSUPPORTED,
                "eval sets {names} use the training agent, but a run with rollout.tasks has one per "
                "task: give each set its `agent` (and `agent_kwargs`)",
                {"names": unnamed},
            )
        return self

    @model_validator(mode="after")
    def _eval_has_session_slots(self) -> ArlConfig:
        """An in-run evaluation keeps its own session slots beside rollout's (the proxy is shared)."""
        in_run = bool(self.eval.versions(self.num_steps))
        if in_run and self.rollout.source == "external":
            raise PydanticCustomError(
                UNSUPPORTED,
                "eval.every / eval.at_start run in the rollout stage, which a run with "
                "rollout.source=external does not have: evaluate its checkpoints with `arl eval` instead",
                {},
            )
        reserve = self.eval.concurrency() if in_run else 0
        if reserve and self.proxy.max_sessions <= reserve:
            raise PydanticCustomError(
                UNSUPPORTED,
                "proxy.max_sessions={slots} leaves rollout no session slot beside the in-run evaluation's {reserve} "
                "(its largest eval set's max_concurrency): raise proxy.max_sessions or lower max_concurrency",
                {"slots": self.proxy.max_sessions, "reserve": reserve},
            )
        return self

    @model_validator(mode="after")
    def _external_agents_have_a_client_key(self) -> ArlConfig:
        """Outside agents start their sessions with a client key: a standalone proxy without one serves nobody."""
        if self.rollout.source == "external" and not self.proxy.client_keys:
            raise PydanticCustomError(
                UNSUPPORTED,
                "rollout.source=external: external agents need a client key to start sessions: "
                'set proxy.client_keys (docs/proxy.md, "Keys")',
                {},
            )
        return self

    @model_validator(mode="after")
    def _workers_are_reached_over_http(self) -> ArlConfig:
        """Several proxy workers are other processes: no agent request can be handed to them in process."""
        if self.proxy.workers > 1 and self.rollout.source == "agent" and self.rollout.agent_transport == "in_process":
            raise PydanticCustomError(
                UNSUPPORTED,
                "proxy.workers={workers} runs the proxy in other processes, which inline agents cannot "
                "reach in process: set rollout.agent_transport=http (or proxy.workers=1)",
                {"workers": self.proxy.workers},
            )
        return self

    @model_validator(mode="after")
    def _sglang_waits_for_disk_only(self) -> ArlConfig:
        """SGLang has no pause that lets requests finish: with `update_mode: wait` the trainer sends the update
        unpaused and SGLang's own lock holds new requests until those in flight are done. That holds for one
        call (a disk load), not across a broadcast's buckets, between which requests would run on half-new
        weights."""
        inf = self.inference
        if inf.backend == "sglang" and inf.update_mode == "wait" and self.trainer.weight_sync == "nccl":
            raise PydanticCustomError(
                UNSUPPORTED,
                "inference.update_mode=wait with inference.backend=sglang needs trainer.weight_sync=disk: SGLang "
                "cannot hold its requests across the buckets of a broadcast; use update_mode=interrupt for nccl",
                {},
            )
        return self
