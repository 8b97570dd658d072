"""Every implementation of a seam satisfies its Protocol (``queue/interface.py``,
``inference/interface.py``): structurally (``isinstance`` of a ``runtime_checkable`` Protocol)
and call for call (each method ``async`` on both sides or on neither, the same parameters in the
same order; the implementation may only add parameters that have defaults, and keeps the
Protocol's defaults). The test fakes that stand in for a client are held to the same check.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_async.config import QueueConfig
from areal_async.inference.client import InferenceClient
from areal_async.inference.interface import AdapterUpdateClient, GenerationClient, WeightUpdateClient
from areal_async.queue.client import QueueClient
from areal_async.queue.core import ReplayQueue
from areal_async.queue.interface import TrainerQueue, WorkerQueue
from areal_async.queue.server import serve
from tests.support.fakes import DiskClient, FakeClient
from tests.support.protocols import check_calls


CALLS = [
    (TrainerQueue, ReplayQueue), (TrainerQueue, QueueClient),
    (WorkerQueue, ReplayQueue), (WorkerQueue, QueueClient),
    (GenerationClient, InferenceClient),
    (WeightUpdateClient, InferenceClient), (WeightUpdateClient, FakeClient),
    (AdapterUpdateClient, InferenceClient),
]


@pytest.mark.parametrize("proto,cls", CALLS, ids=[f"{c.__name__}-{p.__name__}" for p, c in CALLS])
def test_each_implementation_makes_the_calls_of_its_protocol(proto, cls):
    check_calls(proto, cls)


def test_the_call_check_fails_on_a_sync_method_and_on_other_parameters():
    class SyncStats:  # ReplayQueue's stats was sync while QueueClient's was async
        def stats(self):
            pass

    class OtherParams:
        async def stats(self, check):
            pass

    class NoPauseDefault:
        async def pause(self, mode):
            pass

    with pytest.raises(AssertionError, match="SyncStats.stats .* is sync"):
        check_calls(type("P", (), {"stats": TrainerQueue.stats}), SyncStats)
    with pytest.raises(AssertionError, match="extra parameter without default"):
        check_calls(type("P", (), {"stats": TrainerQueue.stats}), OtherParams)
    with pytest.raises(AssertionError, match="mode defaults to"):
        check_calls(type("P", (), {"pause": WeightUpdateClient.pause}), NoPauseDefault)
    with pytest.raises(AssertionError, match="missing"):
        check_calls(TrainerQueue, NoPauseDefault)


def test_the_queues_and_clients_are_instances_of_their_protocols():
    async def body():
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=1), "throughput")
        assert isinstance(queue, TrainerQueue) and isinstance(queue, WorkerQueue)
        _, server = await serve(queue, "127.0.0.1", 0)
        async with await QueueClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], timeout_s=5) as client:
            assert isinstance(client, TrainerQueue) and isinstance(client, WorkerQueue)
        server.close()
        await server.wait_closed()
        async with InferenceClient(["http://127.0.0.1:1"]) as inference:
            assert isinstance(inference, GenerationClient) and isinstance(inference, WeightUpdateClient)
        assert isinstance(DiskClient(), WeightUpdateClient)  # FakeClient without its server processes
        assert not isinstance(DiskClient(), GenerationClient)  # no urls, no generate

    asyncio.run(asyncio.wait_for(body(), 30))
