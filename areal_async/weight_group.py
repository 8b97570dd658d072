"""The trainer→server weight-update process group, outside torch.distributed's default group.

The trainer ranks already own the default group (torchrun); the weight-update group joins
trainer rank 0 (rank 0 here) with every inference server (ranks ``rank_offset + tp_rank``), as
SGLang's ``/init_weights_update_group`` does. It gets its own ``TCPStore`` rendezvous and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) built directly from that store, so it
never touches the default group.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the form SGLang's ``dtypes`` field uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; raises ``ValueError`` for an unsupported dtype name."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported weight dtype '{name}'; use one of {sorted(_DTYPES)}") from None


def new_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group. Blocks until all ranks joined.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        master_address, master_port: the TCPStore that rank 0 (the trainer) listens on.
        rank: this process's rank in the group; 0 is the trainer.
        world_size: 1 + the number of server ranks.
    Raises:
        ValueError: unknown backend or rank outside ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight group rank {rank} is outside [0, {world_size}); check rank_offset")
    if backend not in ("gloo", "nccl"):  # before the store: a bad name must not wait for peers first
        raise ValueError(f"weight group backend '{backend}' is not supported; use 'gloo' or 'nccl'")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def broadcast_(group: dist.ProcessGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast ``tensors`` in place from ``src``, one collective per tensor, in list order."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    for t in tensors:
        group.broadcast([t], opts).wait()


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Start blocking ``fn(*args)`` in a daemon thread; returns a future of its result or exception.

    For the group's blocking calls (joining it, a broadcast): unlike an executor thread, one still
    blocked because a peer never came (waiting for group members, a broadcast a server refused) is
    neither joined at loop close nor at interpreter exit; cancelling the future abandons the
    result.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc: BaseException | None) -> None:
        if not future.done():  # the waiter may have given up
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the waiter, which raises it
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while fn blocked: nobody waits
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=target, name=getattr(fn, "__name__", "blocking"), daemon=True).start()
    return future
