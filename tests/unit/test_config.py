"""Config loading: shipped examples parse, overrides apply, mistakes name the key and the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.errors import ConfigError
from pipeline.run.config import config_from_run_dir, dump_config, load_config, validate_config
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted({*REPO.glob("examples/**/*.yaml"), *REPO.glob("examples/**/*.yml")})


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(REPO)) for p in EXAMPLES])
def test_every_shipped_example_parses(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, ArlConfig)
    # A round trip through the frozen form keeps every value.
    assert validate_config(yaml.safe_load(dump_config(config))) == config


def test_the_examples_glob_sees_the_tree() -> None:
    """Guard the glob itself: if examples/ holds configs, the parametrised test above must see them."""
    on_disk = [p for p in (REPO / "examples").rglob("*") if p.suffix in (".yaml", ".yml")]
    assert sorted(on_disk) == EXAMPLES


def test_defaults_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("experiment_name: exp\ntrainer:\n  optimizer:\n    lr: 0.001\n")
    config = load_config(path, ["trainer.optimizer.lr=2e-6", "rollout.group_size=8", "model.path=/m:x",
                                "inference.extra_args=[--a, --b]", "proxy.admin_key=null"])  # fmt: skip
    assert config.experiment_name == "exp"
    assert config.trainer.optimizer.lr == pytest.approx(2e-6)
    assert config.rollout.group_size == 8
    assert config.model.path == "/m:x"
    assert config.inference.extra_args == ["--a", "--b"]
    assert config.proxy.admin_key is None
    assert config.trainer.backend == "torch"  # untouched defaults stay


def test_unknown_override_key_names_the_key_and_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.optimzer.lr=1"])
    message = str(info.value)
    assert "'trainer.optimzer'" in message and "did you mean 'optimizer'" in message
    assert "algorithm" in message and "weight_sync" in message


def test_unknown_yaml_key_names_the_key_and_the_valid_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "rollout.group_sise" in message and "did you mean 'group_size'" in message
    assert str(path) in message and "batch_size" in message


def test_wrong_literal_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.backend.*'torch' or 'megatron'.*got 'jax'"):
        load_config(None, ["trainer.backend=jax"])
    with pytest.raises(ConfigError, match=r"rollout\.export_style.*'individual' or 'concat'"):
        validate_config({"rollout": {"export_style": "flat"}})


def test_bad_values_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        load_config(None, ["rollout.group_size"])
    with pytest.raises(ConfigError, match="has no sub-keys"):
        load_config(None, ["num_steps.x=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_dump_load_round_trip_through_a_run_dir(tmp_path: Path) -> None:
    overrides = ["experiment_name=rt", "trainer.algorithm.clip_eps_high=0.28", "trainer.optimizer.betas=[0.9, 0.95]",
                 "cluster.train.extra_sbatch=[--x=1]"]  # fmt: skip
    config = load_config(None, overrides)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(dump_config(config))
    assert config_from_run_dir(paths.root) == config
    assert config_from_run_dir(paths.root).trainer.optimizer.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="arl launch"):
        config_from_run_dir(tmp_path / "not-a-run")


def test_a_replaced_key_tells_the_new_one(tmp_path: Path) -> None:
    """`rollout.external: bool` became the strategy `rollout.source: agent | external`."""
    hint = r"rollout\.external.* was replaced: write `rollout\.source: external`"
    with pytest.raises(ConfigError, match=hint):
        load_config(None, ["rollout.external=true"])
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  external: true\n  batch_size: 2\n")
    with pytest.raises(ConfigError, match=hint):
        load_config(path)
    assert load_config(None, ["rollout.source=external", "proxy.client_keys=[k]"]).rollout.source == "external"
    assert load_config(None).rollout.source == "agent"


BROADCAST_TO_SGLANG = ["inference.backend=sglang", "trainer.weight_sync=nccl"]


@pytest.mark.parametrize(
    ("extra_args", "flag"),
    [
        (["--dp-size", "2"], "--dp-size"),
        (["--enable-metrics", "--dp=4"], "--dp"),
        (["--data-parallel-size", "2"], "--data-parallel-size"),
        (["--pp-size=2"], "--pp-size"),
        (["--dp-size", "1", "--pipeline-parallel-size", "4"], "--pipeline-parallel-size"),
    ],
)  # fmt: skip
def test_broadcast_to_sglang_refuses_data_or_pipeline_parallel_servers(tmp_path: Path, extra_args: list[str],
                                                                      flag: str) -> None:  # fmt: skip
    """The broadcast group counts tensor-parallel ranks only: one line naming the flag and the alternative."""
    _assert_refused(tmp_path, "sglang", extra_args, flag)


@pytest.mark.parametrize(
    ("extra_args", "flag"),
    [(["--data-parallel-size", "2"], "--data-parallel-size"), (["-dp", "2"], "-dp"),
     (["--pipeline-parallel-size=2"], "--pipeline-parallel-size"), (["-tp", "2", "-pp", "4"], "-pp")],
)  # fmt: skip
def test_broadcast_to_vllm_refuses_data_or_pipeline_parallel_servers(tmp_path: Path, extra_args: list[str],
                                                                    flag: str) -> None:  # fmt: skip
    """vLLM's own dp/pp flags (full names and short aliases) break the same group arithmetic."""
    _assert_refused(tmp_path, "vllm", extra_args, flag)


def _assert_refused(tmp_path: Path, backend: str, extra_args: list[str], flag: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"inference": {"backend": backend, "extra_args": extra_args},
                                    "trainer": {"weight_sync": "nccl"}}))  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    message = str(refused.value)
    assert "\n" not in message and f"sets {flag} " in message and "trainer.weight_sync=disk" in message, message


@pytest.mark.parametrize(
    "overrides",
    [
        [*BROADCAST_TO_SGLANG, "inference.extra_args=[--dp-size, '1', --tp-size, '4', --enable-metrics]"],
        ["inference.backend=sglang", "trainer.weight_sync=disk", "inference.extra_args=[--dp-size, '2']"],
        ["inference.backend=hf", "trainer.weight_sync=nccl", "inference.extra_args=[--dp-size, '2']"],
        ["inference.backend=vllm", "trainer.weight_sync=nccl", "inference.extra_args=[-tp, '2', -dp, '1']"],
        ["inference.backend=vllm", "trainer.weight_sync=disk", "inference.extra_args=[-dp, '2']"],
    ],
)  # fmt: skip
def test_broadcast_to_sglang_accepts_tensor_parallel_and_disk_takes_any(overrides: list[str]) -> None:
    load_config(None, overrides)


def test_sglang_update_mode_wait_needs_disk_publication() -> None:
    """SGLang holds requests for one unpaused update call, not across a broadcast's buckets: one line, the fix."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*BROADCAST_TO_SGLANG, "inference.update_mode=wait"])
    message = str(refused.value)
    assert "\n" not in message and "trainer.weight_sync=disk" in message and "update_mode=interrupt" in message
    load_config(None, ["inference.backend=sglang", "trainer.weight_sync=disk", "inference.update_mode=wait"])
    load_config(None, [*BROADCAST_TO_SGLANG, "inference.update_mode=interrupt", "inference.pause_mode=in_place"])
    load_config(None, ["inference.backend=vllm", "trainer.weight_sync=nccl", "inference.update_mode=wait"])


def test_arl_launch_dry_run_refuses_it_before_creating_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"fileroot": str(tmp_path / "runs"), "inference": {"backend": "sglang"},
                                    "trainer": {"weight_sync": "nccl"}}))  # fmt: skip
    result = CliRunner().invoke(app, ["launch", str(path), "inference.extra_args=[--dp-size, '2']", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "error: invalid config" in result.output and "--dp-size 2" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "runs").exists()


def test_metrics_wandb_is_off_unless_set_and_one_override_turns_it_on() -> None:
    assert load_config(None).metrics.wandb is None
    config = load_config(None, ["metrics.wandb.mode=offline", "metrics.wandb.tags=[a, b]"])
    wandb = config.metrics.wandb
    assert wandb is not None and (wandb.mode, wandb.project, wandb.entity, wandb.group) == ("offline", "arl", None,
                                                                                           None)  # fmt: skip
    assert wandb.tags == ["a", "b"]
    assert validate_config(yaml.safe_load(dump_config(config))) == config
    assert load_config(None, ["metrics.wandb.mode=offline", "metrics.wandb=null"]).metrics.wandb is None


def test_metrics_wandb_mistakes_name_the_key_and_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.wandb\.mode.*'online', 'offline' or 'disabled'.*got 'shared'"):
        load_config(None, ["metrics.wandb.mode=shared"])
    with pytest.raises(ConfigError, match=r"'metrics\.wandb\.projct' \(did you mean 'project'\?\).*entity"):
        load_config(None, ["metrics.wandb.projct=x"])
    path = tmp_path / "c.yaml"
    path.write_text("metrics:\n  wandb: {project: p, mod: offline}\n")
    with pytest.raises(ConfigError, match=r"'metrics\.wandb\.mod' \(did you mean 'mode'\?\)"):
        load_config(path)


def test_padded_micro_batches_need_the_torch_backend() -> None:
    assert validate_config({"trainer": {"packing": "padded"}}).trainer.packing == "padded"
    with pytest.raises(ConfigError, match=r"trainer\.packing=padded needs trainer\.backend=torch"):
        validate_config({"trainer": {"backend": "megatron", "packing": "padded"}})


def test_several_proxy_workers_need_agents_over_http() -> None:
    """A pool's workers are other processes: inline agents cannot hand them requests in process."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["proxy.workers=2"])
    message = str(refused.value)
    assert "\n" not in message and "rollout.agent_transport=http" in message, message
    load_config(None, ["proxy.workers=2", "rollout.agent_transport=http"])
    load_config(None, ["proxy.workers=2", "rollout.source=external", "proxy.client_keys=[k]"])
    with pytest.raises(ConfigError, match=r"proxy\.workers"):
        load_config(None, ["proxy.workers=0"])


def test_lora_block_and_its_refusals() -> None:
    config = load_config(None, ["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj, v_proj]"])
    assert config.trainer.lora is not None and config.trainer.lora.target_modules == ["q_proj", "v_proj"]
    assert config.trainer.lora.publish == "merged" and load_config(None, []).trainer.lora is None
    with pytest.raises(ConfigError, match=r"trainer\.lora needs trainer\.backend=torch"):
        load_config(None, ["trainer.lora.rank=8", "trainer.backend=megatron"])
    assert load_config(None, ["trainer.lora.publish=adapter"]).trainer.lora.publish == "adapter"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"trainer\.lora\.publish=adapter.*needs trainer\.weight_sync=disk"):
        load_config(None, ["trainer.lora.publish=adapter", "trainer.weight_sync=nccl"])
    with pytest.raises(ConfigError, match=r"modules_to_save needs trainer\.lora\.publish=merged"):
        load_config(None, ["trainer.lora.publish=adapter", "trainer.lora.modules_to_save=[norm]"])
    assert load_config(None, ["trainer.lora.modules_to_save=[norm]"]).trainer.lora.modules_to_save == ["norm"]  # type: ignore[union-attr]


def test_external_agents_without_a_client_key_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.source=external: external agents need a client key"):
        load_config(None, ["rollout.source=external"])
