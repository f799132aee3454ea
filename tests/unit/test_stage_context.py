"""The stage preamble (`open_stage`): attempt number, rank-aware log file, logging, frozen config."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.run.config import dump_config, load_config
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext, open_stage, stage_log_file


@pytest.fixture(autouse=True)
def _keep_root_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`open_stage` configures the root logger, as a stage process should; give pytest's handlers back."""
    for name in ("ARL_ATTEMPT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def _run_dir(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(dump_config(load_config(None, ["num_steps=3", "rollout.batch_size=2"])))
    return paths


def test_open_stage_numbers_the_attempt_and_logs_to_its_file(tmp_path: Path) -> None:
    paths = _run_dir(tmp_path)
    paths.stage_log("rollout", 1).parent.mkdir(parents=True)
    paths.stage_log("rollout", 1).write_text("an earlier attempt\n")
    ctx = open_stage("rollout", paths.root, 2)
    assert (ctx.name, ctx.attempt, ctx.only_step, ctx.rank) == ("rollout", 2, 2, 0)
    assert ctx.config.num_steps == 3 and ctx.config.rollout.batch_size == 2
    logging.getLogger("arl.test").info("hello from attempt 2")
    assert "hello from attempt 2" in paths.stage_log("rollout", 2).read_text()


def test_launched_stage_reads_attempt_and_rank_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _run_dir(tmp_path)
    monkeypatch.setenv("ARL_ATTEMPT", "5")
    monkeypatch.setenv("RANK", "3")
    ctx = open_stage("train", paths.root)
    assert (ctx.attempt, ctx.rank, ctx.only_step) == (5, 3, None)
    # Under `arl launch` the launcher owns the log file (stdout/stderr go there): none is opened here.
    assert not paths.stage_logs("train").exists()


def test_rank_aware_log_names(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert stage_log_file(paths, "train", 4, 0) == paths.stage_log("train", 4)
    assert stage_log_file(paths, "train", 4, 2).name == "attempt_4.rank2.log"


def test_inference_ignores_step(tmp_path: Path) -> None:
    ctx = open_stage("inference", _run_dir(tmp_path).root, 7)
    assert ctx.only_step is None


def test_a_dir_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config at"):
        StageContext.from_run_dir("train", tmp_path)
    with pytest.raises(ConfigError, match="no config at"):
        open_stage("train", tmp_path / "typo")
    assert not (tmp_path / "typo").exists(), "a wrong --run-dir gets no logs/ created in it"
    assert StageContext.from_run_dir("proxy", _run_dir(tmp_path).root, only_step=1).only_step == 1


def test_a_stage_this_run_does_not_have_is_refused_with_the_one_to_start(tmp_path: Path) -> None:
    paths = _run_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"rollout\.source is agent: .*start `arl stage rollout` instead"):
        open_stage("proxy", paths.root)
    external = load_config(None, ["num_steps=3", "rollout.source=external", "proxy.client_keys=[k]"])
    paths.config.write_text(dump_config(external))
    with pytest.raises(ConfigError, match=r"rollout\.source is external: .*start `arl stage proxy` instead"):
        open_stage("rollout", paths.root)
    assert open_stage("proxy", paths.root).name == "proxy"
