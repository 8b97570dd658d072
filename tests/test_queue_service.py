"""The replay queue over real TCP: two clients on one in-process server, and the CLI entry."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from areal_async.config import QueueConfig
from areal_async.queue.client import QueueClient
from areal_async.queue import protocol as p
from areal_async.queue.core import AccountingError, QueueClosed, ReplayQueue
from areal_async.queue.server import serve
from areal_async.trainer.report import queue_metrics
from tests.support.batches import traj
from tests.support.loop import settle


def test_two_clients_end_to_end(tmp_path):
    async def body():
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=0, max_concurrent=8),
                            "deterministic")
        handler, server = await serve(queue, "127.0.0.1", 0, tmp_path / "acct.json")
        port = server.sockets[0].getsockname()[1]
        worker = await QueueClient.connect("127.0.0.1", port, timeout_s=5)
        trainer = await QueueClient.connect("127.0.0.1", port, timeout_s=5)

        assert await worker.lease(0, 8) == [0, 1]  # η = 0: version 0 admits batch 0 only
        # A blocked lease and a blocked get_batch must not stop the submits on either connection.
        leaser = asyncio.create_task(worker.lease(0, 8))
        getter = asyncio.create_task(trainer.get_batch(0))
        await worker.submit(traj(1))
        await worker.submit(traj(0))
        batch = await getter
        assert [t.group_id for t in batch] == [0, 1]
        assert batch[0] == traj(0), "trajectory changed on the wire"
        assert not leaser.done()

        with pytest.raises(ValueError, match="next batch is step 1"):
            await trainer.get_batch(5)
        await trainer.wait_drained(0)
        await trainer.set_version(1)
        assert await leaser == [2, 3]
        await worker.reject(3, "empty prompt")
        s = await trainer.stats()
        assert (s.version, s.leased, s.running, s.consumed, s.rejected) == (1, 4, 1, 2, 1)

        getter = asyncio.create_task(trainer.get_batch(1))
        leaser = asyncio.create_task(worker.lease(0, 8))
        await settle()
        await trainer.close()
        assert await leaser == []
        with pytest.raises(QueueClosed):
            await getter
        acct = json.loads((tmp_path / "acct.json").read_text())
        assert acct["leased"] == 4 and acct["groups"]["3"] == "rejected: empty prompt"
        await worker.disconnect()
        await trainer.disconnect()
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(body(), timeout=60))  # a serialised connection would hang


class _Writes:
    """A stand-in for ``asyncio.StreamWriter`` that records each call that queues bytes."""

    def __init__(self):
        self.calls: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.calls.append(bytes(data))

    def writelines(self, parts) -> None:
        self.calls.append(b"".join(parts))


@pytest.mark.parametrize("size", [0, 300, (1 << 16) + 1])  # empty, a small submit, over _JOIN_BYTES
def test_write_frame_queues_a_frame_in_one_call_and_read_frame_reads_it_back(size):
    async def body():
        payload = bytes(i % 251 for i in range(size))
        writes = _Writes()
        p.write_frame(writes, payload)
        assert writes.calls == [size.to_bytes(4, "big") + payload], "a frame is one write, not two sends"
        reader = asyncio.StreamReader()
        reader.feed_data(writes.calls[0])
        reader.feed_eof()
        assert await p.read_frame(reader) == payload

    asyncio.run(body())


def test_connect_names_the_address():
    with socket.socket() as s:  # a port that is certainly closed: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        async def body():
            await QueueClient.connect("127.0.0.1", port, timeout_s=0.3)

        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
            asyncio.run(body())


def test_cli_serves_and_writes_accounting(tmp_path):
    cfg = {"name": "q", "mode": "throughput", "queue": {"port": 0, "batch_size": 1}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_async.queue.server", "--config",
         str(tmp_path / "config.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("replay queue ready on 127.0.0.1:"), line + proc.stderr.read()
        port = int(line.split()[4].rsplit(":", 1)[1])

        async def body():
            async with await QueueClient.connect("127.0.0.1", port, timeout_s=5) as c:
                [g] = await c.lease(7, 1)
                await c.submit(traj(g))
                assert [t.group_id for t in await c.get_batch(0)] == [0]
                await c.close()

        asyncio.run(body())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    acct = json.loads((tmp_path / "queue_accounting.json").read_text())
    assert (acct["consumed"], acct["groups"]) == (1, {"0": "consumed"})


def test_a_closed_connection_releases_its_groups_and_spares_a_restarted_worker(tmp_path):
    async def body():
        # η = 2: version 0 admits groups 0..5
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=2, max_concurrent=8),
                            "deterministic")
        handler, server = await serve(queue, "127.0.0.1", 0, tmp_path / "acct.json")
        port = server.sockets[0].getsockname()[1]
        connect = lambda: QueueClient.connect("127.0.0.1", port, timeout_s=5)  # noqa: E731
        trainer = await connect()
        dead = await connect()
        assert await dead.lease(0, 2) == [0, 1]
        await dead.submit(traj(0))
        await dead.disconnect()  # what the kernel does to a SIGKILLed worker's socket
        while (await trainer.stats()).requeued != 1:
            await asyncio.sleep(0.01)
        # worker 0 again, on a new connection: group 1 first, then new ids
        again = await connect()
        assert await again.lease(0, 2) == [1, 2]
        # an old connection of worker 0 closing now must not take back the new one's groups
        old = await connect()
        assert await old.lease(0, 1) == [3]
        assert await again.lease(0, 1) == [4]  # worker 0's latest lease is on `again` now
        await old.disconnect()
        await settle()
        s = await trainer.check_accounting()
        assert (s.running, s.requeued, s.released) == (4, 0, 1)
        # the launcher's explicit release, before it starts worker 0 again
        assert await trainer.release(0, restart=True) == [1, 2, 3, 4]
        s = await trainer.check_accounting()
        assert (s.requeued, s.released, s.worker_restarts) == (4, 5, 1)
        # the launcher found server 1 dead and restarts it, then server 0 dead beyond its budget:
        # counted only, no group changes state
        await trainer.server_failed(1, restart=True)
        await trainer.server_failed(0)
        s = await trainer.check_accounting()
        assert (s.server_failures, s.server_restarts, s.requeued, s.running) == (2, 1, 4, 0)
        assert queue_metrics(s)["rollout/server_failures"] == 2.0 and queue_metrics(s)["rollout/server_restarts"] == 1.0
        await trainer.close()
        acct = json.loads((tmp_path / "acct.json").read_text())
        assert (acct["server_failures"], acct["server_restarts"]) == (2, 1)
        assert acct["groups"] == {"0": "ready", "1": "requeued", "2": "requeued", "3": "requeued",
                                  "4": "requeued"} and "violation" not in acct
        for c in (again, trainer):
            await c.disconnect()
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(body(), timeout=60))


def test_the_launchers_release_logs_only_groups_it_took_back(tmp_path, capsys):
    # After a restart the log said "groups [] go back to be leased again" right after the line of the
    # closed connection that had taken them back
    async def body():
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=2, max_concurrent=8), "deterministic")
        handler, server = await serve(queue, "127.0.0.1", 0, tmp_path / "acct.json")
        port = server.sockets[0].getsockname()[1]
        connect = lambda: QueueClient.connect("127.0.0.1", port, timeout_s=5)  # noqa: E731
        launcher, dead = await connect(), await connect()
        assert await dead.lease(0, 2) == [0, 1]
        await dead.disconnect()
        while (await launcher.stats()).requeued != 2:
            await asyncio.sleep(0.01)
        assert await launcher.release(0, restart=True) == []
        err = capsys.readouterr().err
        assert "worker 0's connection closed while it held groups [0, 1]" in err and "released worker" not in err
        again = await connect()
        assert await again.lease(0, 1) == [0]
        assert await launcher.release(0, restart=True) == [0]
        assert "released worker 0 (restarting): groups [0] go back to be leased again" in capsys.readouterr().err
        for c in (again, launcher):
            await c.disconnect()
        server.close()

    asyncio.run(body())


def test_a_broken_accounting_stops_the_service_and_names_the_counts(tmp_path):
    async def body():
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=1), "throughput")
        handler, server = await serve(queue, "127.0.0.1", 0, tmp_path / "acct.json")
        port = server.sockets[0].getsockname()[1]
        async with await QueueClient.connect("127.0.0.1", port, timeout_s=5) as c:
            assert await c.lease(0, 2) == [0, 1]
            queue._consumed += 1  # a count with no group behind it
            with pytest.raises(AccountingError, match="leased 2"):
                await c.check_accounting()
            assert isinstance(handler.failed.result(), AccountingError)
            with pytest.raises(AccountingError):
                await handler.write_accounting()
        acct = json.loads((tmp_path / "acct.json").read_text())
        assert "consumed" in acct["violation"] and acct["groups"] == {"0": "running", "1": "running"}
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(body(), timeout=60))
