"""The CUDA shim that lets megatron-core run on a CPU (CI, laptops). Applied only without CUDA.

megatron-core 0.16.1 builds and trains fine on CPU with gloo except for a few unconditional
`torch.cuda.*` calls (measured; docs/megatron.md "The CUDA shim"):

- `torch.cuda.current_device()` places tensors: rope `inv_freq`, tensor-parallel gather/scatter
  buffers (`mappings.py`, `layers.py`), the global memory buffer, pipeline p2p buffers.
  -> returns the string "cpu", which every one of those callers passes on as `device=`.
- The model-parallel RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`)
  saves, seeds and restores the CUDA generator through `torch.cuda.get_rng_state / set_rng_state /
  manual_seed` and megatron's own `tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state`.
  -> all redirected to the CPU default generator. `fork()` still restores what it swapped out, so the
  global CPU stream is unchanged after a fork (dropout is 0 in our models anyway).
- `torch.cuda.synchronize()` (pipeline p2p with some flags, barriers) -> a no-op: CPU ops are synchronous.
- `Tensor.cuda()`: with tied embeddings and pp > 1 `LanguageModule.setup_embeddings_and_output_layer`
  moves the output-layer copy with `weight.data.cuda()` before syncing it over the embedding group.
  -> returns the tensor itself (it stays on the CPU, where everything else is).

Nothing else is touched. The shim is process-global (megatron reads these attributes at call time),
idempotent, and reversible with `remove()`; on a machine with CUDA `apply()` does nothing, so GPU runs
use megatron-core unmodified.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_saved: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original value) of every patched attribute, in patch order."""


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _cpu_current_device() -> str:
    return "cpu"


def _tensor_stays(self: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    return self


def _patch(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def is_applied() -> bool:
    return bool(_saved)


def apply() -> bool:
    """Install the shim when CUDA is unavailable; returns whether it is installed. Idempotent."""
    if torch.cuda.is_available():
        return False
    if _saved:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "current_device", _cpu_current_device)
    _patch(torch.cuda, "synchronize", _noop)
    _patch(torch.Tensor, "cuda", _tensor_stays)
    for owner in (torch.cuda, torch.cuda.random):
        _patch(owner, "get_rng_state", _cpu_get_rng_state)
        _patch(owner, "set_rng_state", _cpu_set_rng_state)
        _patch(owner, "manual_seed", _cpu_manual_seed)
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    return True


def remove() -> None:
    """Restore every patched attribute (in reverse order, so a twice-patched name gets its original)."""
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)


@contextlib.contextmanager
def cpu_shim() -> Iterator[bool]:
    """`apply()` for the duration of a block (tests); yields whether the shim is active."""
    was_applied = is_applied()
    active = apply()
    try:
        yield active
    finally:
        if active and not was_applied:
            remove()
