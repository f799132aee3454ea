"""Fixtures shared by several integration modules.

Each is started once for the session (it costs seconds to start) and stopped after the last test that uses it
(`pytest_runtest_teardown`), not at the end of the session, so it does not sit idle through the modules after
it nor run beside a server started after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_answers import JudgeJson, sglang_answers  # tests/integration is on sys.path (pytest)
from vllm_process import VLLMServer, vllm_server

_STOPS = {"shared_vllm": contextlib.ExitStack(), "judge_json": contextlib.ExitStack()}
"""What each shared fixture started, closed after its last user (and again, a no-op, at the session's end)."""
_LAST_USER: dict[str, pytest.Item] = {}


@pytest.fixture(scope="session")
def shared_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One vLLM server (the tiny model, 2048 tokens of context) for test_vllm_backend and test_vllm_interrupt:
    starting one takes ~30 s. Each module's own fixture reloads the tiny model's weights as version 0 first
    (`vllm_process.serving`), since tests swap weights. Stopped before test_vllm_lora's starts, which these
    modules do not share: they judge vLLM as a run without LoRA adapters starts it, and with vLLM's LoRA flags its
    layers are wrapped (`...base_layer.weight`), so `/get_weights_by_name` fails there (and with it the
    publisher's verification, on which the broadcast tests then hung)."""
    with _STOPS["shared_vllm"] as stop:
        logs = tmp_path_factory.mktemp("vllm_shared")
        yield stop.enter_context(vllm_server(tiny_model_dir, logs, max_context=2048))


@pytest.fixture(scope="session")
def judge_json(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JudgeJson]:
    """`judge_json(mode, "--", *argv, stdin=None)`: a one-shot SGLang judgement (`routes`, `parse-args`,
    `check-bodies` with `stdin`) and its JSON answer, for test_engine_routes_sglang and test_sglang_contract. One
    `sglang_judge.py answer` process answers them all: it imports SGLang once (~6 s) and runs each in a fork."""
    with _STOPS["judge_json"] as stop:
        yield stop.enter_context(sglang_answers(tmp_path_factory.mktemp("sglang_answers") / "judge.log"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for name in _STOPS:
        users = [item for item in items if name in getattr(item, "fixturenames", ())]
        if users:
            _LAST_USER[name] = users[-1]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, last in _LAST_USER.items():
        if item is last:
            _STOPS[name].close()
