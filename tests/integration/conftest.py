"""Fixtures shared by several integration modules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_process import VLLMServer, vllm_server  # tests/integration is on sys.path (pytest)

SHARED_VLLM = "shared_vllm"
_shared_vllm_stack = contextlib.ExitStack()
_last_shared_vllm_user: list[pytest.Item] = []


@pytest.fixture(scope="session")
def shared_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One vLLM server (the tiny model, 2048 tokens of context) for test_vllm_backend and test_vllm_interrupt:
    starting one takes ~30 s. Each module's own fixture reloads the tiny model's weights as version 0 first
    (`vllm_process.serving`), since tests swap weights. It stops after the last test that uses it
    (`pytest_runtest_teardown`), not at the end of the session, so it never runs beside test_vllm_lora's, which
    these modules cannot share: vLLM's LoRA flags wrap its layers (`...base_layer.weight`), so weights by name
    fail there and the broadcast tests hung."""
    with _shared_vllm_stack:
        logs = tmp_path_factory.mktemp("vllm_shared")
        yield _shared_vllm_stack.enter_context(vllm_server(tiny_model_dir, logs, max_context=2048))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item for item in items if SHARED_VLLM in getattr(item, "fixturenames", ())]
    _last_shared_vllm_user[:] = users[-1:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if item in _last_shared_vllm_user:
        _shared_vllm_stack.close()  # again at the session's end: a no-op
