"""``QueueClient``: the async TCP client of the replay-queue service, call for call ``ReplayQueue``'s.

One connection; calls may overlap (replies routed by request id) and errors come back as the queue
raised them (``ConnectionError`` if it drops; a refused connection fails every call in flight).
Only ``connect`` retries: ``lease`` and ``submit`` are not idempotent, so a call is never resent,
and a cancelled one is not withdrawn. Closing the connection releases the groups it leased.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec

from areal_async.queue import protocol as p
from areal_async.queue.core import AccountingError, QueueClosed, QueueStats
from areal_async.types import Trajectory

_ERRORS = {"ValueError": ValueError, "QueueClosed": QueueClosed, "AccountingError": AccountingError,
           "Unauthorized": PermissionError, "TooLarge": ValueError, "BadRequest": ValueError}


class QueueClient:
    """A connection to the replay queue. Build with ``await QueueClient.connect(host, port)``;
    use as ``async with`` or call ``disconnect()``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str):
        self.address = address
        self._reader = reader
        self._writer = writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(p.Reply)
        self._rids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._lost: BaseException | None = None
        self._reader_task = asyncio.create_task(self._read_replies(), name=f"queue-{address}")

    @classmethod
    async def connect(cls, host: str, port: int, timeout_s: float = 60.0,
                      token: str | None = None) -> "QueueClient":
        """Connect, retrying refused/unreachable attempts with backoff (50 ms doubling to 1 s)
        for up to ``timeout_s`` seconds, then send ``token`` (the job's, ``auth.job_token()``) if given.

        Raises:
            ConnectionError: no connection within ``timeout_s``; names ``host:port``.
            PermissionError: the queue refused ``token`` (or needs one and none was given).
        """
        deadline = time.monotonic() + timeout_s
        delay_s = 0.05
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                break
            except OSError as exc:
                if time.monotonic() + delay_s > deadline:
                    raise ConnectionError(
                        f"replay queue at {host}:{port} not reachable after {timeout_s:.0f} s "
                        f"({exc}); is `python -m areal_async.queue.server` running there?"
                    ) from exc
            await asyncio.sleep(delay_s)  # retry at the network boundary only, bounded
            delay_s = min(2 * delay_s, 1.0)
        client = cls(reader, writer, f"{host}:{port}")
        if token is not None:
            try:
                await client._call(p.Auth, token=token)
            except BaseException:
                await client.disconnect()
                raise
        return client

    async def __aenter__(self) -> "QueueClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.disconnect()

    # ---- the queue's calls -----------------------------------------------------------------

    async def lease(self, worker_id: int, max_groups: int) -> list[int]:
        """Up to ``max_groups`` new group ids; blocks until >= 1 is admitted; ``[]`` once
        the queue is closed."""
        reply = await self._call(p.Lease, worker_id=worker_id, max_groups=max_groups)
        return reply.group_ids

    async def submit(self, traj: Trajectory) -> None:
        """Hand in a finished group (running → ready)."""
        await self._call(p.Submit, traj=traj)

    async def reject(self, group_id: int, reason: str) -> None:
        """Give up on a leased group (running → rejected, with ``reason``)."""
        await self._call(p.Reject, group_id=group_id, reason=reason)

    async def release(self, worker_id: int, restart: bool = False) -> list[int]:
        """Worker ``worker_id`` is gone: its running groups go back to be leased again
        (running → requeued); returns their ids. ``restart``: the launcher starts it again."""
        return (await self._call(p.Release, worker_id=worker_id, restart=restart)).group_ids

    async def server_failed(self, server: int, restart: bool = False) -> None:
        """Count inference server ``server`` found dead or hung (``restart``: started again)."""
        await self._call(p.ServerFailed, server=server, restart=restart)

    async def get_batch(self, step: int) -> list[Trajectory]:
        """Training batch ``step``, sorted by group id; blocks until complete."""
        return (await self._call(p.GetBatch, step=step)).trajectories

    async def set_version(self, version: int) -> None:
        """Announce that ``version`` is live on every server."""
        await self._call(p.SetVersion, version=version)

    async def wait_drained(self, version: int) -> None:
        """Block until every group with ``v(g) <= version`` has finished."""
        await self._call(p.WaitDrained, version=version)

    async def peek_ready(self, below: int) -> list[Trajectory]:
        """Ready groups with id ``< below`` (not consumed), sorted by id."""
        return (await self._call(p.PeekReady, below=below)).trajectories

    async def stats(self) -> QueueStats:
        """A snapshot of the queue's counters."""
        return (await self._call(p.GetStats)).stats

    async def check_accounting(self) -> QueueStats:
        """``stats()`` after the queue checked them against every group's state; raises
        ``AccountingError`` naming the counts (the queue service then stops, status 1)."""
        return (await self._call(p.GetStats, check=True)).stats

    async def close(self) -> None:
        """Close the queue itself (workers' leases then return ``[]``); the connection stays."""
        await self._call(p.Close)

    async def disconnect(self) -> None:
        """Close this connection (the queue keeps running). Idempotent."""
        self._reader_task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass
        self._fail_pending(ConnectionError(f"disconnected from replay queue at {self.address}"))

    # ---- internals -------------------------------------------------------------------------

    async def _call(self, kind: type, **fields):
        if self._lost is not None:
            raise ConnectionError(f"replay queue at {self.address} is gone: {self._lost}")
        rid = next(self._rids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            # No lock: write_frame queues a whole frame without awaiting; concurrent drains wait together.
            p.write_frame(self._writer, self._encoder.encode(kind(rid=rid, **fields)))
            await self._writer.drain()
            reply = await fut
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, p.Error):
            raise _ERRORS.get(reply.kind, RuntimeError)(
                f"replay queue at {self.address}: {reply.message}")
        return reply

    async def _read_replies(self) -> None:
        try:
            while True:
                reply = self._decoder.decode(await p.read_frame(self._reader))
                if reply.rid == p.CONNECTION:  # the queue refused this connection (protocol.py)
                    self._fail_pending(_ERRORS.get(reply.kind, RuntimeError)(
                        f"replay queue at {self.address} refused the connection: {reply.kind}: {reply.message}"))
                    continue
                fut = self._pending.get(reply.rid)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, ValueError,
                msgspec.DecodeError) as exc:
            self._fail_pending(ConnectionError(f"lost the replay queue at {self.address}: "
                                               f"{exc!r}"))

    def _fail_pending(self, exc: Exception) -> None:
        if self._lost is None:  # the first cause is the one to report
            self._lost = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
