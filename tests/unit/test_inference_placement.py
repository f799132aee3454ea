"""Servers of a multi-node inference job: global indices per node, and each server's own GPUs."""

from __future__ import annotations

import pytest

from pipeline.engine.inference.placement import gpu_env, node_rank, server_indices
from pipeline.run.config import load_config


@pytest.fixture(autouse=True)
def _no_slurm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_NNODES", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def test_indices_are_global_across_the_nodes_of_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(None, ["inference.num_servers=4"])
    assert node_rank() == 0 and server_indices(config) == [0, 1, 2, 3]
    monkeypatch.setenv("SLURM_NNODES", "3")
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert node_rank() == 2 and server_indices(config) == [8, 9, 10, 11]
    monkeypatch.setenv("SLURM_NNODES", "1")  # a one-node job: the node id means nothing
    assert server_indices(config) == [0, 1, 2, 3]


def test_each_server_gets_its_slice_of_the_gpus_slurm_gave_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(None, ["inference.backend=sglang", "inference.num_servers=4", "inference.tp_size=2",
                                "cluster.inference.gpus_per_node=8"])  # fmt: skip
    assert [gpu_env(config, i)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    assert gpu_env(config, 5) == {"CUDA_VISIBLE_DEVICES": "10,11"}  # server 5 = slot 1 on its node


def test_servers_share_devices_only_when_there_are_too_few(monkeypatch: pytest.MonkeyPatch) -> None:
    too_many = load_config(None, ["inference.backend=vllm", "inference.num_servers=3", "inference.tp_size=2",
                                  "cluster.inference.gpus_per_node=4"])  # fmt: skip
    assert gpu_env(too_many, 0) == {}
    one = load_config(None, ["inference.num_servers=1", "cluster.inference.gpus_per_node=8"])
    assert gpu_env(one, 0) == {}
    cpu = load_config(None, ["inference.num_servers=2", "inference.device=cpu"])
    assert gpu_env(cpu, 1) == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    hf = load_config(None, ["inference.num_servers=2", "inference.tp_size=4"])  # hf: one device per server
    assert gpu_env(hf, 1) == {"CUDA_VISIBLE_DEVICES": "5"}
