"""Staleness arithmetic and the in-process ReplayQueue state machine.

Concurrency checks drive one event loop: "still blocked" means the waiting task is not done after
the loop has run every ready callback (``settle``), which takes no wall-clock time.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_async.config import QueueConfig
from areal_async.queue.core import AccountingError, QueueClosed, QueueStats, ReplayQueue
from areal_async.queue.staleness import admission_capacity, group_id_limit, group_version
from tests.support.batches import traj
from tests.support.loop import settle


# Each row: (version, accepted, running, B, η, max_concurrent, expected), expected derived by hand
# from min(max_concurrent - running, (η + v + 1) * B - (accepted + running)), clamped at 0.
CAPACITY_TABLE = [
    # η = 0 (synchronous): one batch of B = 4 at a time.
    (0, 0, 0, 4, 0, 16, 4),    # min(16, 1*4 - 0) = 4
    (0, 0, 4, 4, 0, 16, 0),    # min(12, 4 - 4) = 0: batch 0 is all running
    (0, 4, 0, 4, 0, 16, 0),    # min(16, 4 - 4) = 0: batch 0 finished, version 1 not live yet
    (1, 4, 0, 4, 0, 16, 4),    # min(16, 2*4 - 4) = 4: version 1 admits batch 1
    (0, 8, 2, 4, 0, 16, 0),    # min(14, 4 - 10 = -6) -> clamped to 0
    # η = 1: one batch of lookahead.
    (0, 0, 0, 4, 1, 16, 8),    # min(16, 2*4 - 0) = 8
    (0, 4, 3, 4, 1, 16, 1),    # min(13, 8 - 7) = 1
    (2, 10, 2, 4, 1, 16, 4),   # min(14, 4*4 - 12) = 4
    (0, 0, 1, 4, 1, 3, 2),     # min(3 - 1, 8 - 1) = 2: max_concurrent binds
    # Resume from version 3 (B = 4, η = 1): accepted restarts at 3*4 = 12, giving (η+1)*B = 8.
    (3, 12, 0, 4, 1, 16, 8),   # min(16, 5*4 - 12) = 8
    (3, 0, 0, 4, 1, 64, 20),   # the bug a resume must avoid: accepted = 0 admits 20
]


@pytest.mark.parametrize("v,acc,run,b,eta,conc,expected", CAPACITY_TABLE)
def test_admission_capacity_table(v, acc, run, b, eta, conc, expected):
    assert admission_capacity(v, acc, run, b, eta, conc) == expected


def test_admission_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        admission_capacity(0, -1, 0, 4, 1, 8)
    with pytest.raises(ValueError, match="batch_size"):
        admission_capacity(0, 0, 0, 0, 1, 8)


def test_group_version():
    # v(g) = max(0, g // B - η) with B = 4, η = 1: groups 0..7 -> 0, 8..11 -> 1, 12..15 -> 2.
    assert [group_version(g, 4, 1) for g in (0, 7, 8, 11, 12, 15)] == [0, 0, 1, 1, 2, 2]
    assert [group_version(g, 4, 0) for g in (0, 3, 4, 9)] == [0, 0, 1, 2]
    # limit(v) = (v + η + 1) * B is the first id with v(g) > v.
    for v in range(4):
        lim = group_id_limit(v, 4, 1)
        assert group_version(lim - 1, 4, 1) <= v < group_version(lim, 4, 1)


def make(mode: str, b: int = 2, eta: int = 1, conc: int = 8, start_version: int = 0):
    cfg = QueueConfig(batch_size=b, max_staleness=eta, max_concurrent=conc)
    return ReplayQueue(cfg, mode, start_version=start_version)


def test_every_group_accounted_throughput():
    async def body():
        q = make("throughput", b=2, eta=1, conc=4)
        assert await q.lease(0, 10) == [0, 1, 2, 3]  # min(4 - 0, 2*2 - 0) = 4
        await q.submit(traj(2))
        await q.submit(traj(0))
        await q.reject(1, "prompt too long")
        # accepted 2, running 1: min(4 - 1, 4 - 3) = 1 -> the rejected slot is refilled.
        assert (await q.stats()).capacity == 1
        assert await q.lease(1, 10) == [4]
        batch = await q.get_batch(0)  # the first two to finish, sorted by id
        assert [t.group_id for t in batch] == [0, 2]
        s = await q.stats()
        assert (s.leased, s.running, s.ready, s.consumed, s.rejected, s.accepted) == (
            5, 2, 0, 2, 1, 2)
        assert s.leased == s.running + s.ready + s.consumed + s.rejected
        assert q.accounting() == {0: "consumed", 1: "rejected: prompt too long",
                                  2: "consumed", 3: "running", 4: "running"}

    asyncio.run(body())


def test_deterministic_batch_is_exact_id_range():
    async def body():
        q = make("deterministic", b=2, eta=1, conc=8)
        # Version 0 admits ids with v(g) = 0: g < (0 + 1 + 1) * 2 = 4.
        assert await q.lease(0, 8) == [0, 1, 2, 3]
        for g in (3, 2, 1):
            await q.submit(traj(g))
        getter = asyncio.create_task(q.get_batch(0))
        await settle()
        assert not getter.done(), "batch 0 must wait for group 0, not take the first finished"
        await q.submit(traj(0))
        assert [t.group_id for t in await getter] == [0, 1]
        assert [t.group_id for t in await q.get_batch(1)] == [2, 3]

    asyncio.run(body())


def test_throughput_batch_is_first_ready():
    async def body():
        q = make("throughput", b=2, eta=1, conc=8)
        assert await q.lease(0, 8) == [0, 1, 2, 3]
        getter = asyncio.create_task(q.get_batch(0))
        await q.submit(traj(3))
        await settle()
        assert not getter.done()
        await q.submit(traj(1))
        assert [t.group_id for t in await getter] == [1, 3]

    asyncio.run(body())


def test_deterministic_version_gates_admission_and_drain():
    async def body():
        q = make("deterministic", b=2, eta=1, conc=8)
        assert await q.lease(0, 8) == [0, 1, 2, 3]
        leaser = asyncio.create_task(q.lease(1, 8))
        await settle()
        assert not leaser.done(), "group 4 needs version 1"
        with pytest.raises(ValueError, match="wait_drained"):
            await q.set_version(1)
        drain = asyncio.create_task(q.wait_drained(0))
        for g in (0, 1, 2):
            await q.submit(traj(g))
        await settle()
        assert not drain.done(), "group 3 (v = 0) is still running"
        await q.reject(3, "test")
        await drain
        await q.set_version(1)
        # accepted 3, running 0, limit (1+1+1)*2 = 6: min(8, 6 - 3, 6 - 4) = 2.
        assert await leaser == [4, 5]
        batch1 = await q.get_batch(0), await q.get_batch(1)
        assert [[t.group_id for t in b] for b in batch1] == [[0, 1], [2]]

    asyncio.run(body())


def test_wait_drained_counts_groups_not_yet_leased():
    async def body():
        q = make("deterministic", b=2, eta=1, conc=2)
        assert await q.lease(0, 8) == [0, 1]  # max_concurrent = 2 binds
        drain = asyncio.create_task(q.wait_drained(0))  # needs g < 4 finished
        await q.submit(traj(0))
        await q.submit(traj(1))
        await settle()
        assert not drain.done(), "groups 2 and 3 were never leased"
        assert await q.lease(0, 8) == [2, 3]
        await q.submit(traj(2))
        await q.submit(traj(3))
        await drain

    asyncio.run(body())


def test_close_releases_blocked_callers():
    async def body():
        q = make("deterministic", b=2, eta=0, conc=8)
        assert await q.lease(0, 8) == [0, 1]
        leaser = asyncio.create_task(q.lease(0, 8))
        getter = asyncio.create_task(q.get_batch(0))
        drain = asyncio.create_task(q.wait_drained(0))
        await settle()
        assert not (leaser.done() or getter.done() or drain.done())
        await q.close()
        assert await leaser == []
        with pytest.raises(QueueClosed):
            await getter
        with pytest.raises(QueueClosed):
            await drain
        await q.submit(traj(0))  # leased before close: still recorded
        assert (await q.stats()).ready == 1 and (await q.stats()).closed

    asyncio.run(body())


def test_misuse_is_a_clear_error():
    async def body():
        q = make("throughput")
        with pytest.raises(ValueError, match="not leased"):
            await q.submit(traj(0))
        [g] = await q.lease(0, 1)
        await q.submit(traj(g))
        with pytest.raises(ValueError, match="ready"):
            await q.reject(g, "late")
        with pytest.raises(ValueError, match="next batch is step 0"):
            await q.get_batch(1)
        await q.set_version(2)
        with pytest.raises(ValueError, match="goes back"):
            await q.set_version(1)
        with pytest.raises(ValueError, match="max_groups"):
            await q.lease(0, 0)

    asyncio.run(body())


def test_resume_restarts_accepted_at_v_times_b():
    async def body():
        q = make("deterministic", b=2, eta=1, conc=16, start_version=3)
        s = await q.stats()
        # accepted = 3*2 = 6: capacity min(16, (1+3+1)*2 - 6) = 4.
        assert (s.accepted, s.capacity, s.next_step, s.version) == (6, 4, 3, 3)
        assert await q.lease(0, 16) == [6, 7, 8, 9]
        for g in (7, 6):
            await q.submit(traj(g))
        assert [t.group_id for t in await q.get_batch(3)] == [6, 7]

    asyncio.run(body())


def test_resume_with_restored_buffer_continues_like_an_unbroken_run():
    async def body():
        # Unbroken run, B = 2, η = 1, checkpoint after step 2: wait_drained(2) leaves groups 6, 7
        # (v = 2) ready; peek_ready((2 + 1 + 1) * 2) is what the trainer saves.
        q = make("deterministic", b=2, eta=1, conc=16)
        for step in range(3):
            ids = await q.lease(0, 16)
            for g in ids:
                await q.submit(traj(g))
            await q.get_batch(step)
            await q.wait_drained(step)
            saved = await q.peek_ready((step + 2) * 2)
            await q.set_version(step + 1)
        assert [t.group_id for t in saved] == [6, 7]
        assert (await q.stats()).ready == 2  # peeking consumed nothing
        r = ReplayQueue(QueueConfig(batch_size=2, max_staleness=1, max_concurrent=16),
                        "deterministic", start_version=3, restored=saved)
        s = await r.stats()
        # accepted = 6 + 2 restored: capacity min(16, (1 + 3 + 1) * 2 - 8) = 2, the groups of v = 3.
        assert (s.accepted, s.capacity, s.ready, s.leased) == (8, 2, 2, 2)
        assert await r.lease(0, 16) == [8, 9]
        assert [t.group_id for t in await r.get_batch(3)] == [6, 7]
        with pytest.raises(ValueError, match="must be exactly"):
            ReplayQueue(QueueConfig(batch_size=2, max_staleness=1), "deterministic", 3, saved[1:])

    asyncio.run(body())


def test_release_requeues_the_same_ids_before_new_ones():
    async def body():
        q = make("throughput", b=2, eta=1, conc=4)
        assert await q.lease(0, 2) == [0, 1]
        assert await q.lease(1, 2) == [2, 3]
        await q.submit(traj(0))
        # worker 0 dies holding group 1: running 3 -> 2, requeued 1; leased counts ids, still 4
        assert await q.release(0) == [1]
        assert await q.release(0) == []  # idempotent
        s = await q.check_accounting()
        assert (s.leased, s.running, s.ready, s.requeued, s.released, s.accepted) == (4, 2, 1, 1, 1, 1)
        # accepted 1, running 2: min(4 - 2, 2*2 - 3) = 1, the requeued group's slot and no more
        assert s.capacity == 1
        assert q.accounting()[1] == "requeued"
        with pytest.raises(ValueError, match="requeued"):
            await q.submit(traj(1))  # a late submit of the dead worker's group is refused
        assert await q.lease(2, 4) == [1]  # the same id, not the new id 4
        await q.submit(traj(1))
        s = await q.check_accounting()
        # accepted once for group 1: 2; running 2 (groups 2, 3): min(4 - 2, 4 - 4) = 0
        assert (s.leased, s.running, s.ready, s.requeued, s.released, s.accepted, s.capacity) == (
            4, 2, 2, 0, 1, 2, 0)
        assert [t.group_id for t in await q.get_batch(0)] == [0, 1]
        # version 1: min(4 - 2, 3*2 - 4) = 2 new ids
        await q.set_version(1)
        assert await q.lease(2, 4) == [4, 5]

    asyncio.run(asyncio.wait_for(body(), 10))


def test_requeued_ids_go_before_new_ones_lowest_first_with_a_worker_restart():
    async def body():
        q = make("throughput", b=2, eta=2, conc=8)
        assert await q.lease(0, 3) == [0, 1, 2]
        assert await q.lease(1, 1) == [3]
        await q.release(1)
        await q.release(0, restart=True)  # the launcher's call: counted as a restart
        s = await q.stats()
        assert (s.requeued, s.running, s.released, s.worker_restarts) == (4, 0, 4, 1)
        assert await q.lease(5, 2) == [0, 1]
        assert await q.lease(6, 8) == [2, 3, 4, 5]  # the rest of the requeued, then new ids
        await q.check_accounting()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_deterministic_release_holds_the_version_until_the_group_is_done_again():
    async def body():
        q = make("deterministic", b=2, eta=0, conc=8)
        assert await q.lease(0, 8) == [0, 1]
        await q.submit(traj(0))
        assert await q.release(0) == [1]
        # group 1 (v = 0) is requeued, not running: still not drained, version 1 must wait
        drain = asyncio.create_task(q.wait_drained(0))
        getter = asyncio.create_task(q.get_batch(0))
        await settle()
        assert not drain.done() and not getter.done()
        with pytest.raises(ValueError, match="wait_drained"):
            await q.set_version(1)
        # η = 0: group_id_limit(0) - next_id = 2 - 2 = 0 new ids, but the requeued id may go
        assert (await q.stats()).capacity == 1
        assert await q.lease(1, 8) == [1]  # lease's version assertion holds: v(1) = 0 is live
        await q.submit(traj(1))
        await drain
        assert [t.group_id for t in await getter] == [0, 1]
        await q.set_version(1)
        assert await q.lease(1, 8) == [2, 3]
        s = await q.check_accounting()
        assert (s.leased, s.consumed, s.running, s.released, s.accepted) == (4, 2, 2, 1, 2)

    asyncio.run(asyncio.wait_for(body(), 10))


def test_release_on_a_closed_queue_changes_nothing():
    async def body():
        q = make("throughput")
        assert await q.lease(0, 2) == [0, 1]
        await q.close()
        assert await q.release(0) == []
        assert q.accounting() == {0: "running", 1: "running"}

    asyncio.run(asyncio.wait_for(body(), 10))


def test_check_accounting_names_the_counts_of_a_lost_group():
    async def body():
        q = make("throughput")
        assert await q.lease(0, 2) == [0, 1]
        await q.submit(traj(0))
        await q.check_accounting()
        del q._holder[1]  # a group dropped without a state change: what the check is for
        with pytest.raises(AccountingError, match=r"counters \{'running': 0, 'ready': 1.* but groups by state \{'running': 1, 'ready': 1"):
            await q.check_accounting()
        with pytest.raises(AccountingError, match=r"leased 5 != running 1 \+ ready 1 \+ consumed 0 \+ "
                                                  r"rejected 2 \+ requeued 0 = 4"):
            QueueStats(version=0, leased=5, running=1, ready=1, consumed=0, rejected=2, accepted=0,
                       capacity=0, next_step=0, closed=False).check()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_lease_waits_says_whether_a_lease_would_block():
    async def body():
        q = make("throughput", b=2, eta=0, conc=8)
        assert not q.lease_waits()  # capacity min(8 - 0, (0 + 0 + 1) * 2 - 0) = 2
        assert await q.lease(0, 8) == [0, 1]
        assert q.lease_waits()  # min(8 - 2, 2 - (0 + 2)) = 0
        leaser = asyncio.create_task(q.lease(0, 8))
        await settle()
        assert not leaser.done(), "lease_waits said a lease would block, and it did not"
        await q.close()
        assert not q.lease_waits()  # a closed queue answers a lease with [] at once
        assert await leaser == []

    asyncio.run(asyncio.wait_for(body(), 10))
