"""Forward/backward over a list of micro-batches on one pipeline stage (GPipe order).

pp == 1: a plain loop, forward then backward per micro-batch (what megatron's no-pipelining schedule
does). pp > 1: every stage runs all forwards (receiving activations from the previous stage and
sending its output to the next), then all backwards in reverse order (receiving output gradients
from the next stage, sending input gradients to the previous). Sends and receives are matched one
for one and flow in one direction per phase, so plain blocking `send`/`recv` cannot deadlock; this
works over gloo (CPU, tested) and nccl.

Why not megatron's own schedules: in megatron-core 0.16.1 every `forward_backward_*` function
allocates `torch.zeros(..., device="cuda")` unconditionally, so they cannot run on CPU, and we
would rather test one schedule in CI than ship an untested one. The cost of GPipe over 1F1B is
activation memory that grows with the micro-batches of a minibatch; a 1F1B variant is the
natural follow-up for large pp.

Every rank of a stage knows every micro-batch's length (the model-parallel group shares its
micro-batches, see backend.py), so receive buffers are sized without a shape exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.trainer.megatron.forward import PackedInputs, run_stage
from pipeline.trainer.megatron.parallel import Topology

LogitsFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]
"""(micro-batch index, local logits [T, V/tp]) -> scalar loss to backpropagate (None when forward-only)."""


@dataclass(frozen=True)
class StageShape:
    hidden: int
    dtype: torch.dtype
    seq_divisor: int
    """tp with sequence parallelism (activations are split along the sequence), else 1."""


def _peers() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()


def _recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    import torch.distributed as dist

    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=src)
    return buf


def _send(tensor: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist

    dist.send(tensor.contiguous(), dst=dst)


def forward_backward(
    model: torch.nn.Module,
    micros: Sequence[PackedInputs],
    topo: Topology,
    shape: StageShape,
    on_logits: LogitsFn,
    *,
    backward: bool,
) -> None:
    """Run every micro-batch through this stage; with `backward`, accumulate gradients into `.grad`/`main_grad`."""
    prev, nxt = _peers()
    saved: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    with torch.set_grad_enabled(backward):
        for i, inputs in enumerate(micros):
            act_shape = (inputs.padded_len // shape.seq_divisor, 1, shape.hidden)
            received = None if topo.is_first_stage else _recv(act_shape, shape.dtype, topo.device, prev)
            if received is not None and backward:
                received.requires_grad_(True)
            out = run_stage(model, inputs, received)
            if topo.is_last_stage:
                loss = on_logits(i, out)
                if backward and pp_only_one(topo):
                    # pp == 1: backward right away, so only one micro-batch's activations are alive at a time.
                    assert loss is not None
                    loss.backward()
                    continue
                saved.append((received, loss))
            else:
                _send(out.detach(), nxt)
                saved.append((received, out))
    if not backward:
        return
    for received, result in reversed(saved):
        assert result is not None
        if topo.is_last_stage:
            result.backward()
        else:
            grad = _recv(tuple(result.shape), result.dtype, topo.device, nxt)
            torch.autograd.backward(result, grad)
        if received is not None:
            assert received.grad is not None
            _send(received.grad, prev)


def pp_only_one(topo: Topology) -> bool:
    return topo.pp == 1
