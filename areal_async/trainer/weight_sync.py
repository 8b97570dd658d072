"""Pushing the trainer's weights to the inference servers as a new policy version.

``WeightSender`` is the seam: collective over the trainer's ranks (each takes part in gathering the
full tensors), only rank 0 talks to the servers. ``DistributedWeightSender`` (default) broadcasts
buckets over a group of trainer rank 0 and the live servers (gloo on CPU, NCCL on CUDA), rebuilt
when the live set changes; ``DiskWeightSender`` writes ``RUN_DIR/weights/v{N}/`` for them to load.
``rollout.interrupt_on_update`` pauses the servers around an update (their partial outputs are
resubmitted), or lets each update wait for the generations in flight, then sent as one bucket.

Invariants: a send returns once every live server serves the version; a dead server is skipped,
never waited for; a directory named ``v{N}`` is always whole. How: docs/trainer.md#weight-sync;
dead servers: docs/faults.md#an-inference-server-dies-or-hangs.
"""

from __future__ import annotations

import asyncio
import functools
import math
import pathlib
from typing import Protocol

import aiohttp
import torch
import torch.distributed as dist

from areal_async.atomic_dir import remove_atomically
from areal_async.dtypes import dtype_name
from areal_async.inference.client import ServerError
from areal_async.inference.interface import WeightUpdateClient
from areal_async.trainer.checkpoint import hf_metadata_files, write_hf_directory
from areal_async.trainer.policy import full_parameters
from areal_async.weight_group import (DEFAULT_GROUP_NAME, broadcast_, destroy_weight_group, host_store,
                                      in_daemon_thread, new_weight_group)

GROUP_NAME = DEFAULT_GROUP_NAME


class WeightSender(Protocol):
    """Makes the trainer's current weights live on every inference server.

    Both methods are collective over the trainer's default group: every rank calls them, in
    the same order; only rank 0 talks to the servers.
    """

    async def setup(self) -> None:
        """Called once, before the first training step (and before the start-of-run eval)."""

    async def send(self, version: int) -> None:
        """Called after optimizer step k with ``version = k + 1``; returns once every live server
        serves ``version`` (its ``weight_version`` reports it; dead servers: docs/faults.md)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DistributedWeightSender:
    """Broadcast over a trainer-rank-0 + live-servers process group (SGLang's distributed update),
    rebuilt when the set of live servers changes (docs/faults.md).

    Args:
        policy: the (FSDP2/DDP-wrapped) ``PackedPolicy``.
        client: ``InferenceClient`` or a stand-in (rank 0; ``None`` on other ranks), ``num_servers`` servers.
        num_servers: number of inference servers (each live one is one rank of the group).
        master_address, master_port: where rank 0 hosts the group's rendezvous (``TCPStore``; port
            0: a free one), once for every group it builds.
        bucket_bytes: most bytes of tensors per ``/update_weights_from_distributed`` call (with
            interruption; without, the whole model is one call: docs/trainer.md#weight-sync).
        send_dtype: dtype of the broadcast tensors.
        device: the trainer's device (decides gloo vs NCCL).
        interrupt_on_update: pause the servers (mode ``abort``) around the update; ``False``: let
            the update wait for the generations in flight.
    """

    def __init__(self, policy, client: WeightUpdateClient | None, num_servers: int, master_address: str,
                 master_port: int, bucket_bytes: int, send_dtype: torch.dtype, device: torch.device,
                 interrupt_on_update: bool = True):
        assert bucket_bytes > 0, f"bucket_bytes must be > 0, got {bucket_bytes}"
        self.policy, self.client, self.num_servers = policy, client, num_servers
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes, self.send_dtype, self.device = bucket_bytes, send_dtype, device
        self.interrupt_on_update = interrupt_on_update
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.group = None
        self.store = None  # rank 0's rendezvous, hosted at setup for every group (weight_group.host_store)
        self.members: list[int] = []  # the servers of ``group``: ``members[j]`` is its rank 1 + j
        self.group_name = GROUP_NAME
        self.rebuilds = 0  # groups built after the first
        self.served: int | None = None  # the version every member was last sent (None: none yet)

    async def setup(self) -> None:
        if _rank() != 0:
            return
        self.store = host_store(self.master_address, self.master_port)
        self.master_port = self.store.port
        try:
            await self._build(self.client.servers.live())
        except Exception as failure:  # a server that died while joining: built again over the live ones
            await self._recover(failure)

    async def send(self, version: int) -> None:
        rank0, interrupt = _rank() == 0, self.interrupt_on_update
        if rank0:
            await self.client.servers.probe(require_version=False)  # a restarted server joins the next group
            if interrupt:
                await self.client.pause()  # finds a server that died unseen (it leaves routing)
        # without a pause, each call waits for the servers' requests in flight on its own, and those
        # held behind one bucket would run before the next: one call for the whole model
        bucket_bytes = self.bucket_bytes if interrupt else math.inf
        try:
            if rank0:
                await self._follow_live_servers()
            for attempt in (1, 2):
                failure = await self._send_version(version, bucket_bytes)  # rank 0's error, or None
                decision = _DONE
                if failure is not None:
                    try:
                        if attempt == 2:
                            raise RuntimeError(
                                f"weight version {version} failed again after the weight-update group was rebuilt "
                                f"over {self._urls(self.members)}: {type(failure).__name__}: {failure}") from failure
                        await self._recover(failure, refusal_rebuilds=True)
                        decision = _SEND_AGAIN
                    except BaseException:
                        _decide(_STOP, self.device)  # the other ranks stop too, rather than wait for a gather
                        raise
                decision = _decide(decision, self.device)
                if decision == _STOP:
                    raise RuntimeError(f"trainer rank 0 could not send weight version {version} to the inference "
                                       f"servers; its log names the error")
                if decision == _DONE:
                    break
            self.served = version
        finally:
            if interrupt and rank0:
                await self.client.continue_generation()

    async def _send_version(self, version: int, bucket_bytes: float) -> Exception | None:
        """Every parameter in buckets; collective (every rank gathers every parameter, also after a
        failure). Returns rank 0's first failure (then the rest is not sent), else ``None``."""
        failure = None
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, full in self._named_tensors():
            if full is None or failure is not None:  # not rank 0, or failed: took part in the gather only
                continue
            tensor = full.to(self.send_dtype).contiguous()
            if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
                failure = await self._try_bucket(bucket, version)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        if bucket and failure is None:
            failure = await self._try_bucket(bucket, version)
        return failure

    async def _try_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> Exception | None:
        try:
            await self._send_bucket(bucket, version)
        except Exception as exc:  # judged by _recover: a server's death is survived, anything else raised
            return exc
        return None

    async def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        calls = asyncio.gather(*(self._announce(i, names, dtypes, shapes, version) for i in self.members))
        # The servers join the broadcast when their HTTP call arrives; ours blocks until then.
        broadcast = in_daemon_thread(broadcast_, self.group, [t for _, t in bucket])
        await _with_server_calls(broadcast, calls, f"a server refused the bucket of {len(names)} tensors "
                                                   f"({names[0]}, ...) of weight version {version}, so the "
                                                   f"broadcast cannot complete")

    def _named_tensors(self):
        """``(name, full tensor or None)`` of everything a version sends, collective over the
        trainer's ranks (``None`` on ranks other than 0): every parameter (``full_parameters``).
        ``lora_sync.DistributedAdapterSender`` sends an adapter's tensors instead."""
        return full_parameters(self.policy)

    async def _announce(self, server: int, names: list[str], dtypes: list[str], shapes: list[list[int]],
                        version: int):
        """``server``'s ``/update_weights_from_distributed`` call for one bucket."""
        return await self.client.update_weights_from_distributed(server, names, dtypes, shapes, version,
                                                                 self.group_name)

    async def _follow_live_servers(self) -> None:
        """Rank 0, before an update: rebuild the group if a member left routing, a server came back,
        or a member was restarted unseen (its version is behind the last one sent)."""
        restarted = await self._restarted()
        if self.client.servers.live() != self.members or restarted:
            await self._rebuild(restarted)

    async def _recover(self, failure: Exception, refusal_rebuilds: bool = False) -> None:
        """Rank 0, after a failed join or bucket: members that no longer answer ``GET /ready`` (any
        status; not ``/health``, which on SGLang waits behind the pause: ``routing.py``) leave
        routing and the group is rebuilt over the live servers. When every member still answers,
        none was restarted and no call lost its connection (a refusal, not a death): raises
        ``failure``, or with ``refusal_rebuilds`` rebuilds over the same members (a member
        restarted unseen before the first version was sent serves the same version as the group,
        and only its refusal shows that it is outside it; a real refusal fails again)."""
        pool = self.client.servers
        for i in self.members:
            if i in pool.live() and not await pool.alive(i):
                pool.take_out(i, f"the weight update failed ({type(failure).__name__}) and /ready does not answer")
        restarted = await self._restarted()
        refused = pool.live() == self.members and not restarted and not _lost_connection(failure)
        if refused and not refusal_rebuilds:
            raise failure
        why = ("a server restarted outside the group refuses so: it is built again over the same servers, once"
               if refused else f"the group is built again over {self._urls(pool.live())}")
        print(f"[trainer] a weight-group call failed ({type(failure).__name__}: {failure}); {why}", flush=True)
        await self._rebuild(restarted)

    async def _restarted(self) -> list[int]:
        """Live members serving a version behind the last one sent: new processes, outside the group."""
        if self.served is None:
            return []
        live = [i for i in self.members if i in self.client.servers.live()]
        versions = await asyncio.gather(*(self.client.servers.version(i) for i in live))
        return [i for i, v in zip(live, versions) if v is not None and v < self.served]

    async def _rebuild(self, restarted: list[int]) -> None:
        """Destroy the group (rank 0's, then each surviving member's) and build one over the live
        servers under the next name (docs/faults.md)."""
        live = self.client.servers.live()
        survivors = [i for i in self.members if i in live and i not in restarted]
        print(f"[trainer] rebuilding the weight-update group '{self.group_name}' of {self._urls(self.members)} "
              f"over {self._urls(live)}", flush=True)
        if self.group is not None:
            # first ours: its connections close, which ends a survivor's receive blocked in it (gloo)
            destroy_weight_group(self.group)
            self.group = None
        results = await asyncio.gather(*(self.client.destroy_weights_update_group(i, self.group_name)
                                         for i in survivors), return_exceptions=True)
        for i, result in zip(survivors, results):
            if isinstance(result, BaseException):  # it holds an unused group; the join decides whether it is fine
                print(f"[trainer] {self.client.urls[i]} did not destroy weight group '{self.group_name}': "
                      f"{type(result).__name__}: {result}", flush=True)
        self.rebuilds += 1
        await self._build(live)

    async def _build(self, members: list[int]) -> None:
        """Join ``members`` (server ``members[j]`` as rank ``1 + j``) and rank 0 into a new group."""
        if not members:
            self.client.servers.route(0)  # raises NoServerLeft naming each server and why it left
        name = GROUP_NAME if self.rebuilds == 0 else f"{GROUP_NAME}_{self.rebuilds}"
        world_size = 1 + len(members)
        # the group being built: after a failed join, _recover judges these members and _rebuild
        # asks the survivors to free this name
        self.members, self.group_name = list(members), name
        joins = asyncio.gather(*(
            self.client.init_weights_update_group(
                i, self.master_address, self.master_port, 1 + j, world_size, self.backend, name)
            for j, i in enumerate(members)
        ))
        group = in_daemon_thread(functools.partial(new_weight_group, self.backend, self.master_address,
                                                   self.master_port, 0, world_size, group_name=name,
                                                   store=self.store))
        self.group = await _with_server_calls(
            group, joins, f"a server of {self._urls(members)} refused to join the weight group '{name}' at "
                          f"{self.master_address}:{self.master_port}")

    def _urls(self, servers: list[int]) -> list[str]:
        return [self.client.urls[i] for i in servers]


def _lost_connection(failure: BaseException) -> bool:
    """Whether a server's call in ``failure`` (or its cause) ended with the connection, not an
    answer: the server died or was restarted, though it may answer again by now."""
    cause = failure.__cause__ if failure.__cause__ is not None else failure
    return isinstance(cause, (aiohttp.ClientConnectionError, ConnectionError)) and not isinstance(cause, ServerError)


_DONE, _SEND_AGAIN, _STOP = 0, 1, 2  # rank 0's decision after sending a version, for every rank


def _decide(decision: int, device: torch.device) -> int:
    """Rank 0's ``decision`` on every trainer rank (one broadcast over the default group; the
    other ranks' argument is ignored)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decision
    flag = torch.tensor([decision], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


async def _with_server_calls(ours: asyncio.Future, calls: asyncio.Future, refused: str):
    """Our side of a group operation (``ours``: joining, a broadcast, blocking in a daemon thread)
    and the servers' HTTP calls that make them take part; returns ``ours``' result. A server that
    refuses its call never takes part, so a failed call ends the wait at once, raising
    ``RuntimeError(refused: <the call's error>)`` (``ours`` would otherwise block until the group's
    timeout). A failure of ours still waits for the calls, and theirs surfaces first."""
    await asyncio.wait([ours, calls], return_when=asyncio.FIRST_EXCEPTION)
    if calls.done() and calls.exception() is not None and not ours.done():
        ours.cancel()  # abandoned: the daemon thread stays blocked and does not hold up the exit
        raise RuntimeError(f"{refused}: {calls.exception()}") from calls.exception()
    try:
        return await ours
    finally:
        await calls


class DiskWeightSender:
    """Write an HF checkpoint per version and have each server load it.

    Args:
        policy: the (FSDP2/DDP-wrapped) ``PackedPolicy``.
        client: ``InferenceClient`` or a stand-in on rank 0, ``None`` elsewhere.
        num_servers: number of inference servers.
        base_model_path: the starting HF directory (config, generation config and tokenizer to
            copy).
        weights_dir: where ``v{version}/`` directories are written (``RUN_DIR/weights``); must
            be readable by the servers.
        save_dtype: dtype of the written floating-point weights (the servers').
        interrupt_on_update: pause the servers (mode ``abort``) around the load; ``False``: each
            server's load waits for its generations in flight.
    """

    def __init__(self, policy, client: WeightUpdateClient | None, num_servers: int, base_model_path: str,
                 weights_dir: pathlib.Path, save_dtype: torch.dtype, interrupt_on_update: bool = True):
        self.policy, self.client, self.num_servers = policy, client, num_servers
        self.interrupt_on_update = interrupt_on_update
        self.base_model_path, self.weights_dir, self.save_dtype = base_model_path, pathlib.Path(weights_dir), save_dtype
        self._metadata: dict[str, bytes] | None = None  # config, generation config, tokenizer; rendered once
        self._previous: pathlib.Path | None = None

    async def setup(self) -> None:
        return None

    async def send(self, version: int) -> None:
        tensors, devices = {}, set()
        for name, full in full_parameters(self.policy):  # collective: every rank takes part in each gather
            if full is not None:
                tensors[name] = _to_host(full, self.save_dtype if full.is_floating_point() else full.dtype)
                if full.is_cuda:
                    devices.add(full.device)
        if _rank() != 0:
            return
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking device-to-host copies have landed
        if self._metadata is None:
            self._metadata = hf_metadata_files(self.base_model_path, self.save_dtype)
        path = await asyncio.to_thread(write_hf_directory, self.weights_dir / f"v{version}", tensors, self._metadata)
        await self.client.servers.probe(require_version=False)  # a restarted server gets this version too
        if self.interrupt_on_update:
            await self.client.pause()
        try:
            await self.client.each_live(lambda i: self.client.update_weights_from_disk(i, str(path.resolve()), version))
        finally:
            if self.interrupt_on_update:
                await self.client.continue_generation()
        if self._previous is not None and self._previous != path:
            remove_atomically(self._previous)  # whole or gone: the launcher restarts a server from the newest
        self._previous = path


def _to_host(full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``full`` in ``dtype`` on the CPU: cast where it lives; from CUDA into pinned memory without
    waiting (the caller synchronises once for all parameters). The pinned buffers return to torch's
    caching host allocator when the update is written, and serve the next update."""
    cast = full.to(dtype)
    if not cast.is_cuda:
        return cast
    host = torch.empty(cast.shape, dtype=dtype, pin_memory=True)
    host.copy_(cast, non_blocking=True)
    return host
