"""Rank 0's ``Coordinator`` over an in-process ``ReplayQueue``, and its ``Follower`` twin.

The queue is the real state machine (it refuses ``set_version(v)`` in deterministic mode until
every group of version ≤ v-1 has finished, and checks its accounting); sender, evaluations,
learner, logger and inference client are one recorder that appends to one list of events, so the
tests read the order of the coordinator's calls.
"Still blocked" means not done after the loop ran every ready callback (``settle``).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from areal_async.config import load_config
from areal_async.jitter import Jitter
from areal_async.queue.core import AccountingError, ReplayQueue
from areal_async.trainer.coordinator import Coordinator, Follower, checkpoint_due
from areal_async.trainer.report import Timer
from tests.support.batches import traj
from tests.support.loop import settle


class Recorder:
    """Sender, evaluations, learner, metrics logger and inference client in one: each call
    appends an event."""

    def __init__(self):
        self.events: list[tuple] = []
        self.elapsed_before_s = 0.0

    def log(self, step, metrics):
        self.events.append(("log", step, metrics))

    def start(self, version):
        self.events.append(("eval_start", version))

    async def weight_versions(self):  # of the live servers
        return {0: 1}

    async def send(self, version):
        self.events.append(("send", version))

    async def finish(self):
        self.events.append(("eval_wait",))

    def save_checkpoint(self, step, buffer, elapsed_s):
        self.events.append(("save", step, [t.group_id for t in buffer]))


def coordinator(mode: str, checkpoint_every: int) -> tuple[Coordinator, ReplayQueue, Recorder]:
    # B = 2, η = 1: v(g) = max(0, g // 2 - 1), so groups 0..3 are of version 0, 4..5 of version 1
    cfg = load_config(None, [f"mode={mode}", "queue.batch_size=2", "queue.max_staleness=1",
                             "queue.max_concurrent=8", "trainer.total_steps=4",
                             f"trainer.checkpoint_every={checkpoint_every}"])
    queue, rec = ReplayQueue(cfg.queue, mode), Recorder()
    coord = Coordinator(cfg, rec, rec, Jitter(0, 0), rec, queue, rec, rec, None)
    return coord, queue, rec


def test_checkpoint_due_every_n_steps_and_at_the_end():
    t = load_config(None, ["trainer.total_steps=5", "trainer.checkpoint_every=2"]).trainer
    assert [s for s in range(1, 6) if checkpoint_due(s, t)] == [2, 4, 5]
    t = load_config(None, ["trainer.total_steps=5", "trainer.checkpoint_every=0"]).trainer
    assert [s for s in range(1, 6) if checkpoint_due(s, t)] == [5]


def test_deterministic_publish_waits_for_the_drain_and_keeps_the_ready_groups():
    async def body():
        coord, queue, rec = coordinator("deterministic", checkpoint_every=1)
        assert await queue.lease(0, 8) == [0, 1, 2, 3]  # version 0 admits groups 0..3 only
        for g in (0, 1, 2):
            await queue.submit(traj(g))
        await queue.get_batch(0)  # groups 0, 1
        publish = asyncio.create_task(coord.publish(1, Timer()))
        await settle()
        assert not publish.done() and rec.events == []  # group 3 (version 0) still generating
        await queue.submit(traj(3))
        await publish
        assert rec.events == [("eval_wait",), ("send", 1)]
        assert (await queue.stats()).version == 1
        await coord.settle(0)  # the checkpoint of version 1 keeps the finished, unconsumed 2 and 3
        assert rec.events[-1] == ("save", 1, [2, 3])

    asyncio.run(body())


def test_deterministic_publish_keeps_no_groups_without_a_checkpoint():
    async def body():
        coord, queue, rec = coordinator("deterministic", checkpoint_every=0)
        await queue.lease(0, 8)
        for g in range(4):
            await queue.submit(traj(g))
        await queue.get_batch(0)
        await coord.publish(1, Timer())
        await coord.settle(0)  # step 1 of 4: no checkpoint due
        assert rec.events == [("eval_wait",), ("send", 1)]

    asyncio.run(body())


def test_throughput_publish_does_not_wait_and_a_checkpoint_keeps_no_groups():
    async def body():
        coord, queue, rec = coordinator("throughput", checkpoint_every=1)
        assert await queue.lease(0, 8) == [0, 1, 2, 3]
        for g in (0, 1):
            await queue.submit(traj(g))
        await queue.get_batch(0)
        await coord.publish(1, Timer())  # groups 2 and 3 still generating: no wait
        await coord.settle(0)
        assert rec.events == [("eval_wait",), ("send", 1), ("save", 1, [])]
        assert (await queue.stats()).version == 1

    asyncio.run(body())


def test_log_completes_the_step_metrics_from_the_queues_checked_accounting():
    async def body():
        coord, queue, rec = coordinator("throughput", checkpoint_every=0)
        await queue.lease(0, 8)
        for g in (0, 1, 2):
            await queue.submit(traj(g))
        trajs = await queue.get_batch(0)
        timer = Timer()
        with timer("step_s"):
            pass
        await coord.log(0, trajs, {"train/tokens": 8.0}, timer)
        assert [e[:2] for e in rec.events] == [("log", 0), ("eval_start", 1)]
        metrics = rec.events[0][2]
        # leased 4 (0..3), ready 1 (2), running 1 (3): QueueStats of check_accounting
        assert (metrics["queue/ready"], metrics["queue/running"]) == (1.0, 1.0)
        assert (metrics["version/trainer"], metrics["version/servers"]) == (1, 1)
        # traj(): 2 tokens per sample, of version 0, taken at step 0
        assert metrics["rollout/response_len"] == 2.0 and metrics["staleness/max"] == 0.0
        queue._consumed += 1  # a count with no group behind it
        with pytest.raises(AccountingError, match="consumed"):
            await coord.log(1, trajs, {"train/tokens": 8.0}, timer)

    asyncio.run(body())


def test_the_follower_answers_every_call_of_the_coordinator():
    # train() calls the same methods on both, never asking which rank it runs on
    def calls(cls):
        return {name: (inspect.iscoroutinefunction(f), list(inspect.signature(f).parameters))
                for name, f in vars(cls).items() if not name.startswith("_") and callable(f)
                and name != "open"}

    assert calls(Follower) == calls(Coordinator)
    assert set(calls(Coordinator)) == {"take", "training", "publish", "log", "settle", "finish"}


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_a_follower_joins_only_the_weight_send_and_the_checkpoint(mode):
    async def body():
        cfg = load_config(None, [f"mode={mode}", "trainer.total_steps=2", "trainer.checkpoint_every=0"])
        rec = Recorder()
        follower = Follower(cfg, rec, rec, Jitter(0, 0))
        for k in range(2):
            await follower.publish(k + 1, Timer())
            await follower.log(k, [], {}, Timer())
            await follower.settle(k)
        await follower.finish()
        assert rec.events == [("send", 1), ("send", 2), ("save", 2, [])]

    asyncio.run(body())
