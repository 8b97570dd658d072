"""The trainer→server weight-update process group, outside torch.distributed's default group.

Trainer rank 0 is rank 0, server ranks ``rank_offset + tp_rank``. Invariant: built exactly as
SGLang's ``init_custom_process_group`` builds it, so either end can be SGLang; one group per name
per process, and ``host_store`` lets rank 0 build successive named groups over one store.
How: docs/trainer.md#weight-sync; rebuilds: docs/faults.md#an-inference-server-dies-or-hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .dtypes import dtype_name
from .tcp_store import hosted_store

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name of both weight endpoints


def new_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group. Blocks until all ranks joined.

    Built as SGLang's ``init_custom_process_group`` builds it (docs/trainer.md#weight-sync), so a
    peer running SGLang's helper with the same ``group_name`` meets this one.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (any case, as torch's ``Backend`` reads it).
        master_address, master_port: the TCPStore that rank 0 (the trainer) listens on.
        rank: this process's rank in the group; 0 is the trainer.
        world_size: 1 + the number of server ranks.
        timeout_s: seconds to wait for the peers (the store) and for each collective.
        group_name: SGLang's ``group_name``: the store's key prefix and the group's registered
            name; every member must use the same one.
        store: rank 0 only: a store already hosted on ``master_address:master_port``
            (``host_store``; shared by successive groups of distinct names); ``None``: host one.
    Raises:
        ValueError: unknown backend, rank outside ``[0, world_size)``, an empty group name, a
            group of that name already held by this process (``destroy_weight_group`` it first),
            or a ``store`` given to a rank other than 0.
        torch.distributed.DistError: the peers did not all join within ``timeout_s``.
        OSError: rank 0 cannot listen on ``master_address:master_port`` (taken, or not an address
            of this machine).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight group rank {rank} is outside [0, {world_size}); check rank_offset")
    if str(backend).lower() not in ("gloo", "nccl"):  # before the store: a bad name must not wait for peers first
        raise ValueError(f"weight group backend '{backend}' is not supported; use 'gloo' or 'nccl'")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"weight group name {group_name!r} is not a non-empty string; send the group_name "
                         f"every member uses (SGLang's default is '{DEFAULT_GROUP_NAME}')")
    if group_name in c10d._world.pg_names.values():  # before the store, as torch's check is after it
        raise ValueError(f"this process already holds a process group named '{group_name}'; destroy it "
                         f"first or use another group_name")
    if store is not None and rank != 0:
        raise ValueError(f"weight group rank {rank} was given a store; only rank 0 hosts the rendezvous")
    timeout = datetime.timedelta(seconds=timeout_s)
    # the store torch's tcp:// rendezvous opens (SGLang's init_method), hosted by rank 0
    if store is not None:
        pass  # hosted by the caller (host_store), shared with earlier groups of other names
    elif rank == 0:  # listening on master_address only, not on every interface (tcp_store.py)
        store = hosted_store(master_address, master_port, world_size, timeout, multi_tenant=True)
    else:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout,
                              multi_tenant=True)
    store.set_timeout(timeout)
    with _unbound_default_group(backend):
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), dist.PrefixStore(group_name, store),
            group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # as SGLang: group rank == rank
    return group


def host_store(master_address: str, master_port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``master_address:master_port``, for ``new_weight_group(...,
    store=)``: several groups, one after another, each under its own ``group_name`` (docs/faults.md
    says why). Returns at once (it does not wait for peers: each group's join does).

    Raises:
        OSError: ``master_address:master_port`` cannot be bound (taken, or not an address of this
            machine).
    """
    return hosted_store(master_address, master_port, None, datetime.timedelta(seconds=timeout_s),
                        multi_tenant=True, wait_for_workers=False)


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    """Shut ``group`` down and release its name (``torch.distributed.destroy_process_group``)."""
    dist.destroy_process_group(group)


@contextlib.contextmanager
def _unbound_default_group(backend: str):
    """Lift the default group's device binding while an NCCL weight group is built (docs/trainer.md#weight-sync
    says why); a no-op for gloo or without a bound default group."""
    default = c10d.GroupMember.WORLD if dist.is_initialized() else None
    bound = default.bound_device_id if default is not None else None
    if bound is None or str(backend).lower() != "nccl":
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def receive_buffers(dtypes: list[torch.dtype], shapes: list[list[int]], device: torch.device | str,
                    flattened: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Empty tensors to receive one bucket into: ``(received, tensors)``, the tensors the
    broadcasts fill (in order) and the bucket's tensors (one per dtype/shape, in that order).

    Per tensor (SGLang's default ``load_format``) both are the same list. ``flattened``
    (SGLang's ``"flattened_bucket"``, its ``FlattenedTensorBucket``): one ``[total_bytes] uint8``
    tensor, every tensor's bytes concatenated in order, and the tensors as views into it.

    Raises:
        ValueError: ``flattened`` with no tensors, or a tensor whose byte offset in the flat
            buffer is not a multiple of its element size (SGLang refuses both too).
    """
    if not flattened:
        tensors = [torch.empty(s, dtype=d, device=device) for d, s in zip(dtypes, shapes)]
        return tensors, tensors
    if not dtypes:
        raise ValueError("a flattened_bucket of no tensors cannot be received; send at least one name")
    offsets, offset = [], 0
    for dtype, shape in zip(dtypes, shapes):
        if offset % dtype.itemsize:
            raise ValueError(f"tensor {len(offsets)} ({dtype_name(dtype)}) would start at byte {offset} of the "
                             f"flattened_bucket, not a multiple of its {dtype.itemsize}-byte elements; order "
                             f"the bucket by element size, largest first")
        offsets.append(offset)
        offset += math.prod(shape) * dtype.itemsize
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    tensors = [flat[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
               for start, dtype, shape in zip(offsets, dtypes, shapes)]
    return [flat], tensors


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
