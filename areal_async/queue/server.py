"""The replay queue as an asyncio TCP service (one ``ReplayQueue`` behind ``protocol`` frames).

    python -m areal_async.queue.server --config RUN_DIR/config.yaml [--start-version V]
        [--restore RUN_DIR/checkpoint/buffer.msgpack]

Prints ``replay queue ready on HOST:PORT``. A request that may wait runs as its own task, the
others in order. A closed connection releases its workers' groups (docs/faults.md). The accounting
is checked each step and at the end, and written to ``RUN_DIR/queue_accounting.json``; a failed
check or broken invariant exits 1, SIGTERM/SIGINT exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import traceback

import msgspec

from areal_async import auth
from areal_async.config import load_config
from areal_async.jitter import Jitter
from areal_async.queue import protocol as p
from areal_async.queue.core import AccountingError, QueueClosed, ReplayQueue
from areal_async.types import Trajectory


_UNAUTHORIZED = "send the job's token first (an Auth frame; QueueClient.connect(..., token=AREAL_ASYNC_TOKEN))"


class QueueServer:
    """Serves one ``ReplayQueue`` to any number of TCP clients.

    Args:
        queue: the state machine.
        accounting_path: where ``write_accounting`` puts the JSON snapshot (``None``: nowhere).
        jitter: random delay before each request is dispatched (``None``: none).
        token: the job's token every connection must send first (``None``: no check).
        max_request_bytes: the largest request frame read; a larger one closes its connection.
    """

    def __init__(self, queue: ReplayQueue, accounting_path: pathlib.Path | None = None,
                 jitter: Jitter | None = None, token: str | None = None,
                 max_request_bytes: int = p.MAX_FRAME_BYTES):
        self.queue = queue
        self.token, self.max_request_bytes = token, max_request_bytes
        self.jitter = jitter
        self.accounting_path = accounting_path
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._decoder = msgspec.msgpack.Decoder(p.Request)
        self._encoder = msgspec.msgpack.Encoder()
        self._connections = 0
        self._lessee: dict[int, int] = {}  # worker id -> the connection of its latest granted lease

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read frames, answer each request from its own task."""
        authed = self.token is None
        self._connections += 1
        conn = self._connections
        try:
            async with asyncio.TaskGroup() as tg:
                calls: set[asyncio.Task] = set()
                while True:
                    try:
                        payload = await p.read_frame(reader, self.max_request_bytes)
                    except (asyncio.IncompleteReadError, ConnectionError):
                        break
                    except p.FrameTooLarge as exc:  # its payload is unread: the stream cannot go on
                        await self._refuse(writer, "TooLarge", str(exc), close=True)
                        break
                    try:
                        req = self._decoder.decode(payload)
                    except msgspec.DecodeError as exc:
                        if not authed:
                            await self._refuse(writer, "Unauthorized", _UNAUTHORIZED, close=True)
                            break
                        await self._refuse(writer, "BadRequest", f"not a queue request: {exc}")
                        continue
                    if not authed or isinstance(req, p.Auth):
                        if not isinstance(req, p.Auth) or (self.token is not None
                                                           and not auth.same(req.token, self.token)):
                            await self._refuse(writer, "Unauthorized", _UNAUTHORIZED, close=True)
                            break
                        authed = True
                        await self._send(writer, p.Ack(rid=req.rid))
                        continue
                    if self._waits(req):
                        task = tg.create_task(self._answer(req, writer, conn))
                        calls.add(task)
                        task.add_done_callback(calls.discard)
                    else:  # answered before the next frame is read: no task to schedule
                        await self._answer(req, writer, conn)
                for task in calls:  # the client is gone: nobody will read these answers
                    task.cancel()
        finally:
            await self._release_connection(conn)  # after its calls ended: no lease still granting
            writer.close()

    def _waits(self, req: p.Request) -> bool:
        """Whether answering ``req`` may wait on the queue (or on injected jitter): such a call
        runs as its own task, so it holds up no other call of its connection. Every other call
        is answered in the read loop, as a task per call cost more than the queue's own work."""
        match req:
            case p.GetBatch() | p.WaitDrained():
                return True
            case p.Lease():
                return self.jitter is not None or self.queue.lease_waits()
        return self.jitter is not None

    async def _release_connection(self, conn: int) -> None:
        """The client of ``conn`` left: put back the groups its worker ids hold."""
        for worker_id in [w for w, c in self._lessee.items() if c == conn]:
            del self._lessee[worker_id]
            ids = await self.queue.release(worker_id)
            if ids:
                print(f"[queue] worker {worker_id}'s connection closed while it held groups {ids}; "
                      f"they go back to be leased again", file=sys.stderr, flush=True)

    async def _answer(self, req: p.Request, writer: asyncio.StreamWriter, conn: int = 0):
        try:
            if self.jitter is not None:
                await self.jitter()  # injected timing noise: reorders concurrent queue calls
            reply = await self._dispatch(req, conn)
        except ValueError as exc:
            reply = p.Error(rid=req.rid, kind="ValueError", message=str(exc))
        except QueueClosed as exc:
            reply = p.Error(rid=req.rid, kind="QueueClosed", message=str(exc))
        except Exception as exc:  # a broken invariant: tell the caller, then stop the service
            kind = "AccountingError" if isinstance(exc, AccountingError) else "internal"
            reply = p.Error(rid=req.rid, kind=kind, message=str(exc) if kind != "internal" else repr(exc))
            if not self.failed.done():
                self.failed.set_result(exc)
        await self._send(writer, reply)

    async def _send(self, writer: asyncio.StreamWriter, reply: p.Reply) -> None:
        # No lock: write_frame queues a whole frame without awaiting, and concurrent drains wait
        # together (a client that does not read holds up every answer of its connection).
        try:
            p.write_frame(writer, self._encoder.encode(reply))
            await writer.drain()
        except ConnectionError:
            pass  # the client left; its reader loop ends this connection

    async def _refuse(self, writer: asyncio.StreamWriter, kind: str, message: str,
                      close: bool = False) -> None:
        """Answer a frame that is no call with a connection-level ``Error``; ``close``: log it too
        (the caller then ends the connection)."""
        if close:
            peer = writer.get_extra_info("peername")
            print(f"[queue] closing a connection from {peer}: {kind}: {message}", file=sys.stderr, flush=True)
        await self._send(writer, p.Error(rid=p.CONNECTION, kind=kind, message=message))

    async def _dispatch(self, req: p.Request, conn: int = 0) -> p.Reply:
        q, rid = self.queue, req.rid
        match req:
            case p.Lease():
                ids = await q.lease(req.worker_id, req.max_groups)
                if ids:
                    self._lessee[req.worker_id] = conn
                return p.Leased(rid=rid, group_ids=ids)
            case p.Release():
                ids = await q.release(req.worker_id, req.restart)
                if ids:  # none: the queue took them back when the worker's connection closed (logged then)
                    print(f"[queue] released worker {req.worker_id}"
                          f"{' (restarting)' if req.restart else ''}: groups {ids} go back to be leased again",
                          file=sys.stderr, flush=True)
                return p.Released(rid=rid, group_ids=ids)
            case p.ServerFailed():
                await q.server_failed(req.server, req.restart)
                print(f"[queue] inference server {req.server} failed"
                      f"{' (restarting)' if req.restart else ''}", file=sys.stderr, flush=True)
            case p.Submit():
                await q.submit(req.traj)
            case p.Reject():
                await q.reject(req.group_id, req.reason)
            case p.GetBatch():
                return p.Batch(rid=rid, trajectories=await q.get_batch(req.step))
            case p.SetVersion():
                await q.set_version(req.version)
            case p.WaitDrained():
                await q.wait_drained(req.version)
            case p.PeekReady():
                return p.Batch(rid=rid, trajectories=await q.peek_ready(req.below))
            case p.GetStats():
                return p.Stats(rid=rid, stats=await (q.check_accounting() if req.check else q.stats()))
            case p.Close():
                await q.close()
                await self.write_accounting()
            case _:
                raise AssertionError(f"unhandled request {type(req).__name__}")
        return p.Ack(rid=rid)

    async def write_accounting(self) -> None:
        """Check the accounting, then write ``stats()`` plus every group's state to
        ``accounting_path`` (atomically; ``violation``: the failed check's message).

        Raises:
            AccountingError: the check failed (after the file is written).
        """
        violation = None
        try:
            await self.queue.check_accounting()
        except AccountingError as exc:
            violation = exc
        if self.accounting_path is not None:
            data = msgspec.to_builtins(await self.queue.stats())
            if violation is not None:
                data["violation"] = str(violation)
            data["groups"] = {str(g): s for g, s in self.queue.accounting().items()}
            tmp = self.accounting_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.accounting_path)
        if violation is not None:
            raise violation


async def serve(queue: ReplayQueue, host: str, port: int,
                accounting_path: pathlib.Path | None = None,
                jitter: Jitter | None = None, token: str | None = None,
                max_request_bytes: int = p.MAX_FRAME_BYTES) -> tuple[QueueServer, asyncio.Server]:
    """Start serving ``queue`` on ``host:port``; returns the handler and the listening server
    (``server.sockets[0].getsockname()[1]`` is the port when ``port`` was 0). ``token`` and
    ``max_request_bytes``: see ``QueueServer``.

    Raises:
        ValueError: a non-loopback ``host`` without a ``token`` (``auth.require_token``).
    """
    auth.require_token(host, token, f"the replay queue (queue.host={host})")
    handler = QueueServer(queue, accounting_path, jitter, token, max_request_bytes)
    server = await asyncio.start_server(handler.handle, host, port)
    return handler, server


async def main(config_path: str, start_version: int, restore: str | None = None) -> int:
    cfg = load_config(config_path)
    run_dir = pathlib.Path(config_path).resolve().parent
    restored = (msgspec.msgpack.decode(pathlib.Path(restore).read_bytes(), type=list[Trajectory])
                if restore else [])
    queue = ReplayQueue(cfg.queue, cfg.mode, start_version=start_version, restored=restored)
    jitter = Jitter(cfg.debug.jitter_ms, cfg.debug.jitter_seed, "queue")
    try:
        handler, server = await serve(queue, cfg.queue.host, cfg.queue.port,
                                      run_dir / "queue_accounting.json", jitter if jitter.enabled else None,
                                      auth.job_token(), cfg.queue.max_request_bytes)
    except ValueError as exc:
        print(f"[queue] error: {exc}", file=sys.stderr, flush=True)
        return 2
    port = server.sockets[0].getsockname()[1]
    print(f"replay queue ready on {cfg.queue.host}:{port} (mode {cfg.mode}, "
          f"B = {cfg.queue.batch_size}, η = {cfg.queue.max_staleness})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, handler.failed], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    server.close()
    try:
        await handler.write_accounting()
    except AccountingError as exc:
        if not handler.failed.done():
            handler.failed.set_result(exc)
    if handler.failed.done():
        exc = handler.failed.result()
        traceback.print_exception(exc)
        return 1
    return 0


def cli(argv: list[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m areal_async.queue.server")
    parser.add_argument("--config", required=True, help="the run's resolved config.yaml")
    parser.add_argument("--start-version", type=int, default=0,
                        help="version already trained (resume): batches restart at this step")
    parser.add_argument("--restore", default=None,
                        help="msgpack list of ready trajectories saved with the checkpoint")
    args = parser.parse_args(argv)
    return uvloop.run(main(args.config, args.start_version, args.restore))


if __name__ == "__main__":
    sys.exit(cli())
