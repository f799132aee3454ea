"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2 checkpoint with the Qwen2.5 chat template, built once per session."""
    from pipeline.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), template="qwen")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model with the Llama 3.1 chat template and special tokens, built once per session."""
    from pipeline.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), template="llama3")


@pytest.fixture
def make_train_run(tmp_path: Path, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """Factory: a run dir with a frozen config (tiny model, CPU trainer) and synthetic trajectory steps.

    `make_train_run(steps=[0, 1], overrides=[...], name="run")` writes config.yaml and, for each step,
    synthetic rows (rewarded and unrewarded completions per group) with real behaviour log-probs of
    the tiny model. Returns the run's `RunPaths`.
    """
    from pipeline.config import dump_config, load_config
    from pipeline.handoff import write_text_atomic
    from pipeline.paths import RunPaths
    from pipeline.shards import write_step
    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows

    def make(steps: list[int] = [0], overrides: list[str] = [], name: str = "run", **rows_kw):  # noqa: B006
        config = load_config(None, [f"fileroot={tmp_path}", "experiment_name=x", f"trial_name={name}",
                                    f"model.path={tiny_model_dir}", "trainer.device=cpu", *overrides])  # fmt: skip
        paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
        write_text_atomic(paths.config, dump_config(config))
        for step in steps:
            rows = add_behaviour_logprobs(synthetic_rows(step, **rows_kw), tiny_model_dir)
            write_step(paths, step, rows, producer="rollout", tokenizer=str(tiny_model_dir))
        return paths

    return make
