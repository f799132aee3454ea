"""The weight-broadcast group joined from inside torchrun, as a multi-GPU or multi-node trainer joins it.

torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in its workers; torch's `tcp://` rendezvous then makes
every rank, rank 0 included, a client of a store it expects torchrun's agent to host on that port.
For the weight group that store is the trainer's own, so rank 0 must host it regardless.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.engine.weight_group import broadcast_from_trainer, destroy_weight_group, init_weight_group
from pipeline.net.addresses import free_port

REPO = Path(__file__).resolve().parents[2]
RECEIVER = """
import sys, torch
from pipeline.engine.weight_group import init_weight_group, receive_from_trainer
group = init_weight_group("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, group_name="wg-torchrun",
                          backend="gloo", timeout_s=30)
(tensor,) = receive_from_trainer(group, ["float32"], [[3]], "cpu")
print("received", tensor.tolist(), flush=True)
"""


def test_trainer_under_torchrun_hosts_the_weight_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun gives every worker
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    try:
        group = init_weight_group("127.0.0.1", port, rank=0, world_size=2, group_name="wg-torchrun", backend="gloo",
                                  timeout_s=30)  # fmt: skip
        broadcast_from_trainer(group, [torch.tensor([1.0, 2.0, 3.0])])
        destroy_weight_group(group)
        out, _ = receiver.communicate(timeout=60)
    finally:
        receiver.kill()
    assert receiver.returncode == 0, out
    assert "received [1.0, 2.0, 3.0]" in out
