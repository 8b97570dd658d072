"""The trainer→server weight-update process group, outside torch.distributed's default group.

The trainer ranks already own the default group (torchrun); the weight-update group joins
trainer rank 0 (rank 0 here) with every inference server (ranks ``rank_offset + tp_rank``), as
SGLang's ``/init_weights_update_group`` does. It is built exactly as SGLang's
``sglang.srt.utils.common.init_custom_process_group`` builds it (what a real SGLang server runs
for its side, and what slime's and AReaL's trainers use for theirs), so either end can be SGLang:

- the rendezvous is a ``TCPStore`` on ``master_address:master_port`` that rank 0 hosts, opened
  with the arguments of torch's ``tcp://`` rendezvous (``world_size`` peers, multi-tenant,
  libuv); it is opened here rather than through ``rendezvous()``, which under torchrun
  (``TORCHELASTIC_USE_AGENT_STORE``) would make rank 0 a client too, with nobody hosting. Rank 0's
  store listens on ``master_address`` only (``tcp_store.hosted_store``; torch's own would listen
  on every interface), so the peers must be given an address of rank 0's machine, as for SGLang;
- the store is wrapped in ``PrefixStore(group_name, store)`` and the group built by torch's
  ``_new_process_group_helper`` with the same world size, rank, ``global_ranks_in_group=[]``,
  group name and timeout, so every key of the join lives under
  ``<group>/<group>//<device>//`` (``cpu`` for gloo, ``cuda`` for NCCL), e.g. gloo's
  ``weight_update_group/weight_update_group//cpu//0/1``;
- the group is registered in torch's process-group registry under ``group_name`` (as SGLang's
  is), so one process holds one group of each name: ``destroy_weight_group`` releases it.

Rebuilding (``trainer/weight_sync.py``, after a server died or came back): rank 0 may host the
store once (``host_store``) and build successive groups over it, each under a new
``group_name``. The name is the store's key prefix, so a new group never reads the keys an old
one left there (a dead server's address among them); the servers' side is unchanged, a
``TCPStore`` client per join, as SGLang's. Destroying a group that a daemon thread is still
blocked in (a broadcast, ``in_daemon_thread``) releases its name at once; measured with gloo on
CPU (torch 2.13), the thread stays blocked until its peers close their side or the timeout ends
it, and the group's connections close when that thread lets go of it.

One difference, on CUDA only: when the caller's default group is bound to a device
(``init_process_group(device_id=...)``, as the trainer does), ``_new_process_group_helper``
would make the NCCL communicator by splitting the default group's, a collective of the trainer's
ranks that the servers are not part of; the binding is lifted while the group is built, so the
communicator is made through the store as on the SGLang side (which binds no device).
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

    Built as SGLang's ``init_custom_process_group`` builds it (see the module docstring), so a
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
    store=)``: several groups, one after another, each under its own ``group_name`` (module
    docstring). Returns at once (it does not wait for peers: each group's join does).

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
    """Lift the default group's device binding while an NCCL weight group is built (the module
    docstring says why); a no-op for gloo or without a bound default group."""
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
