"""The weight-broadcast group between the trainer (rank 0) and the inference servers (ranks 1..).

Both sides build the group the same way the RL frameworks that drive SGLang do (SGLang's
`init_custom_process_group`, also used by verl, AReaL and OpenRLHF): a `tcp://` rendezvous on the
trainer's address (rank 0 hosts the store), a `PrefixStore` named after the group so several
groups can share a port, and a process group created beside (not as) the process's default group.
So a trainer that uses `init_weight_group` can publish to a real SGLang server, and our `hf`
server accepts a trainer written for SGLang.

Tensors are broadcast from rank 0 one by one, in the order of the `names` list of
`/update_weights_from_distributed`; every receiver allocates `shapes[i]` of `dtypes[i]`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from pipeline.net.addresses import interface_of, route_source


def init_weight_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 600.0,
) -> Any:
    """Join (rank 0: host) the broadcast group; blocks until all `world_size` ranks have joined."""
    timeout = timedelta(seconds=timeout_s)
    with _gloo_interface(master_address, backend, host=rank == 0):
        return _join(master_address, master_port, rank, world_size, group_name, backend, timeout)


def _join(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout: timedelta
) -> Any:
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import TCPStore

    # The store directly, not `c10d.rendezvous("tcp://...")`: under torchrun (a multi-GPU or multi-node
    # trainer) rendezvous sees TORCHELASTIC_USE_AGENT_STORE and makes rank 0 a mere client of a store it
    # assumes torchrun's agent hosts on that port, so nobody hosts it and every rank waits out the deadline.
    store: Any = TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout, multi_tenant=True)
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # The options keyword was renamed across torch versions (pg_options -> backend_options).
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    helper: Any = c10d._new_process_group_helper  # private API: its annotations differ across torch versions
    group, _ = helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@contextlib.contextmanager
def _gloo_interface(master_address: str, backend: str, *, host: bool) -> Iterator[None]:
    """While a gloo group is created: its interface, unless `GLOO_SOCKET_IFNAME` already names one.

    Gloo binds to the address the machine's host name resolves to, which on many machines is a
    loopback alias (Debian's `127.0.1.1`) that no other node reaches. The group's rendezvous address
    says which interface to use instead: the one holding it (the trainer, which hosts it) or the one
    on the route to it (a server). `cluster.network_interface` sets `GLOO_SOCKET_IFNAME` explicitly.
    """
    if backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME") or master_address in ("127.0.0.1", "localhost"):
        yield
        return
    local = master_address if host else route_source(master_address)
    ifname = interface_of(local)
    if ifname is None:
        yield
        return
    # Gloo reads the variable when the group is built. No lock: a group joined at the same moment in
    # another thread of this process (tests only) would at worst fall back to gloo's own choice.
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def destroy_weight_group(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def broadcast_from_trainer(group: Any, tensors: list[torch.Tensor]) -> None:
    """Rank 0: send `tensors` in order (they must be contiguous; on the group's device)."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_from_trainer(
    group: Any,
    dtypes: list[str],
    shapes: list[list[int]],
    device: torch.device | str,
    into: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Ranks > 0: receive one tensor per (dtype, shape), in order; into `into[i]` where given (it must fit)."""
    import torch.distributed as dist

    received = []
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        buffer = into[i] if into is not None else None
        tensor = buffer if buffer is not None else torch.empty(shape, dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        received.append(tensor)
    return received


def parse_dtype(name: str) -> torch.dtype:
    """`bfloat16` or `torch.bfloat16` -> torch.bfloat16 (the names SGLang's protocol carries)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as float32 or bfloat16")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what `/update_weights_from_distributed` expects in `dtypes`)."""
    return str(dtype).removeprefix("torch.")
