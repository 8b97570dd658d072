"""``ReplayQueue``: the in-process, asyncio state machine behind the replay-queue service.

It owns the sequence-id allocator, admission control (the staleness bound of
``staleness.admission_capacity``), the buffer of finished groups, and the order in which the
trainer sees them. Every group id it hands out is accounted for::

    leased (= running, held by a worker) ──submit──▶ ready ──get_batch──▶ consumed
        │  ▲                             └─reject(reason)─▶ rejected
 release│  │lease (the same id, before any new one)
        ▼  │
      requeued

A lease moves an id straight to ``running``: the queue cannot see a worker start work, so
"leased" and "running" are one state here, remembered with the worker that holds it.
``release(worker_id)`` (the worker's connection closed, or the launcher says it died) moves the
groups that worker held to ``requeued``: they keep their ids and go to the next leases, lowest id
first and before any new id, so group g is generated again with the same prompt and sampling
seeds (both functions of g) and the batch of g still waits for it. A requeued group is neither
running nor accepted: it frees its admission slot, which its next lease takes again.

Two batching modes (docs/design.md):

- ``deterministic``: batch k is exactly the groups ``[k*B, (k+1)*B)`` that did not get
  rejected, sorted by id; group g is admitted only while its version ``v(g)`` is the live one,
  and ``set_version(j+1)`` is refused until every group with ``v(g) <= j`` has finished
  (``wait_drained(j)``). Wall-clock order decides nothing.
- ``throughput``: batch k is the first B groups to finish, sorted by id.

All structures are bounded by admission: the buffer never holds more than the staleness bound
lets in. Blocking calls wake on one "something changed" event and re-check their condition;
``close()`` wakes them all: ``lease`` then returns ``[]``, ``get_batch``/``wait_drained`` raise
``QueueClosed``. Submits and rejects of already leased groups are still recorded after close, so
the accounting stays complete. The queue lives on one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import msgspec

from areal_async.config import QueueConfig
from areal_async.queue.staleness import admission_capacity, group_id_limit, group_version
from areal_async.types import Trajectory

Mode = Literal["deterministic", "throughput"]
RUNNING, READY, CONSUMED, REJECTED, REQUEUED = "running", "ready", "consumed", "rejected", "requeued"


class QueueClosed(RuntimeError):
    """The queue was closed while a caller waited for a batch or a drain."""


class AccountingError(AssertionError):
    """The queue's counters and its per-group states disagree: some group was lost or counted
    twice (a bug in the queue, never bad input). The message names the counts."""


class QueueStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the queue. Counts are groups since this queue started.

    Invariant: ``leased == running + ready + consumed + rejected + requeued`` (``check``).
    ``leased`` counts distinct ids, so a group leased again after a release counts once;
    ``released`` counts every return of a group by ``release`` and ``worker_restarts`` the
    launcher's restarts of a dead worker (``release(..., restart=True)``); ``server_failures``
    and ``server_restarts`` the inference servers the launcher found dead or hung and started
    again (``server_failed``).
    """

    version: int
    leased: int
    running: int
    ready: int
    consumed: int
    rejected: int
    accepted: int
    capacity: int
    next_step: int
    closed: bool
    requeued: int = 0
    released: int = 0
    worker_restarts: int = 0
    server_failures: int = 0
    server_restarts: int = 0

    def check(self) -> None:
        """Raise ``AccountingError`` naming the counts unless ``leased`` is the sum of the
        states."""
        total = self.running + self.ready + self.consumed + self.rejected + self.requeued
        if self.leased != total:
            raise AccountingError(
                f"queue accounting broken: leased {self.leased} != running {self.running} + "
                f"ready {self.ready} + consumed {self.consumed} + rejected {self.rejected} + "
                f"requeued {self.requeued} = {total}")


class ReplayQueue:
    """Staleness-bounded, sequence-id-ordered buffer of trajectories (one event loop).

    Args:
        cfg: ``batch_size`` (B), ``max_staleness`` (η), ``max_concurrent``.
        mode: ``deterministic`` or ``throughput`` (see the module docstring).
        start_version: version already trained when the queue starts (a resume). The allocator,
            ``accepted`` and the next batch step restart at ``start_version * B`` and
            ``start_version`` (docs/design.md: after a resume, ``accepted`` restarts at ``v * B``).
            Groups whose ``v(g)`` is older than ``start_version`` are generated by
            ``start_version`` unless ``restored`` holds them.
        restored: finished, unconsumed groups saved with the checkpoint (``peek_ready``), ids
            ``start_version * B, start_version * B + 1, …`` without gaps; they enter as ready, so
            a deterministic resume from a checkpoint taken after ``wait_drained(start_version -
            1)`` replays an unbroken run exactly.

    Raises:
        ValueError: a non-positive ``batch_size``/``max_concurrent``, negative ``max_staleness``
            or ``start_version``, an unknown mode, or ``restored`` ids that are not contiguous
            from ``start_version * B``.
    """

    def __init__(self, cfg: QueueConfig, mode: Mode, start_version: int = 0,
                 restored: list[Trajectory] = ()):
        if mode not in ("deterministic", "throughput"):
            raise ValueError(f"queue mode '{mode}' is not 'deterministic' or 'throughput'")
        if cfg.batch_size < 1 or cfg.max_concurrent < 1 or cfg.max_staleness < 0:
            raise ValueError(
                f"queue needs batch_size >= 1, max_concurrent >= 1, max_staleness >= 0; got "
                f"{cfg.batch_size}, {cfg.max_concurrent}, {cfg.max_staleness}"
            )
        if start_version < 0:
            raise ValueError(f"start_version must be >= 0, got {start_version}")
        self.mode: Mode = mode
        self._b = cfg.batch_size
        self._eta = cfg.max_staleness
        self._max_concurrent = cfg.max_concurrent
        self._version = start_version
        self._start_version = start_version
        self._first_id = start_version * self._b
        self._next_id = self._first_id  # the sequence-id allocator
        self._accepted = start_version * self._b
        self._next_step = start_version
        self._state: dict[int, str] = {}
        self._holder: dict[int, int] = {}  # running group -> worker id
        self._ready: dict[int, Trajectory] = {}  # insertion order = finishing order
        self._reasons: dict[int, str] = {}
        self._requeued: list[int] = []  # released ids, sorted: leased again before any new id
        self._consumed = 0
        self._released = 0
        self._worker_restarts = 0
        self._server_failures = self._server_restarts = 0
        self._closed = False
        self._changed = asyncio.Event()
        restored = sorted(restored, key=lambda t: t.group_id)
        want = list(range(self._first_id, self._first_id + len(restored)))
        if [t.group_id for t in restored] != want:
            raise ValueError(f"restored groups {[t.group_id for t in restored]} must be exactly {want}")
        for traj in restored:
            self._state[traj.group_id] = READY
            self._ready[traj.group_id] = traj
        self._next_id += len(restored)
        self._accepted += len(restored)

    # ---- workers -------------------------------------------------------------------------

    async def lease(self, worker_id: int, max_groups: int) -> list[int]:
        """Hand out up to ``max_groups`` group ids to ``worker_id``: requeued ids first (lowest
        first), then new ones; block until >= 1 is admitted. Returns ``[]`` once the queue is
        closed.

        Raises:
            ValueError: ``max_groups < 1``.
        """
        if max_groups < 1:
            raise ValueError(f"lease needs max_groups >= 1, got {max_groups}")
        # Backpressure: wait while the staleness bound or max_concurrent is full, because more
        # groups now would be trained too stale or would overload the inference servers.
        await self._wait_until(lambda: self._closed or self._admissible() > 0)
        if self._closed:
            return []
        n = min(max_groups, self._admissible())
        again, self._requeued = self._requeued[:n], self._requeued[n:]
        ids = again + list(range(self._next_id, self._next_id + n - len(again)))
        self._next_id += n - len(again)
        for g in ids:
            if self.mode == "deterministic":
                # After a resume from version s, groups with v(g) < s are generated by s.
                need = max(group_version(g, self._b, self._eta), self._start_version)
                assert need == self._version, (
                    f"group {g} needs version {need} but {self._version} is live: "
                    f"set_version skipped a drain"
                )
            self._state[g] = RUNNING
            self._holder[g] = worker_id
        self._notify()
        return ids

    def lease_waits(self) -> bool:
        """Whether ``lease`` would block now: the queue is open and admits no group."""
        return not self._closed and self._admissible() == 0

    async def submit(self, traj: Trajectory) -> None:
        """Record the finished group ``traj.group_id``: running → ready.

        Raises:
            ValueError: the group is not running (never leased, or already finished).
        """
        g = traj.group_id
        self._expect_running(g, "submit")
        del self._holder[g]
        self._state[g] = READY
        self._ready[g] = traj
        self._accepted += 1
        self._notify()

    async def reject(self, group_id: int, reason: str) -> None:
        """Record that a leased group will never produce a trajectory: running → rejected.

        In throughput mode its admission slot is freed for a new group; in deterministic mode
        batch ``group_id // B`` is trained without it.

        Raises:
            ValueError: the group is not running.
        """
        self._expect_running(group_id, "reject")
        del self._holder[group_id]
        self._state[group_id] = REJECTED
        self._reasons[group_id] = reason
        self._notify()

    async def release(self, worker_id: int, restart: bool = False) -> list[int]:
        """Take back every group ``worker_id`` holds (running → requeued): the worker is gone.

        Called when the worker's connection closes and by the launcher before it starts the
        worker again (``restart=True``, counted in ``stats().worker_restarts``). Idempotent: a
        second call finds nothing. On a closed queue nothing changes (no group would be leased
        again; the ones in flight at the end stay ``running``). Returns the released ids, sorted.
        """
        if self._closed:
            return []
        ids = sorted(g for g, w in self._holder.items() if w == worker_id)
        for g in ids:
            del self._holder[g]
            self._state[g] = REQUEUED
        self._requeued = sorted(self._requeued + ids)
        self._released += len(ids)
        self._worker_restarts += int(restart)
        self._notify()
        return ids

    async def server_failed(self, server: int, restart: bool) -> None:
        """Count inference server ``server`` found dead or hung by the launcher (``restart``: it
        is being started again). No group changes state: a generation in flight on it goes on
        on another server (``areal_async/inference/routing.py``)."""
        assert server >= 0, f"server index must be >= 0, got {server}"
        self._server_failures += 1
        self._server_restarts += int(restart)
        self._notify()

    # ---- trainer -------------------------------------------------------------------------

    async def get_batch(self, step: int) -> list[Trajectory]:
        """Batch ``step`` (steps are taken in order, 0, 1, 2, … from ``start_version``),
        sorted by group id; its groups become consumed. Blocks until the batch is complete.

        Deterministic mode: the non-rejected groups of ``[step*B, (step+1)*B)`` (fewer than B
        only if some were rejected). Throughput mode: the first B groups that finished.

        Raises:
            ValueError: ``step`` is not the next step.
            QueueClosed: the queue was closed before the batch was complete.
        """
        if step != self._next_step:
            raise ValueError(f"get_batch({step}): the next batch is step {self._next_step}")
        if self.mode == "deterministic":
            span = range(step * self._b, (step + 1) * self._b)
            done = lambda: all(self._state.get(g) in (READY, REJECTED) for g in span)  # noqa: E731
            # Backpressure: the trainer waits for the exact id range, never for whoever finished.
            await self._wait_until(lambda: self._closed or done())
            if not done():
                raise QueueClosed(f"queue closed before batch {step} was complete")
            ids = [g for g in span if self._state[g] == READY]
        else:
            # Backpressure: the trainer waits until a full batch has finished.
            await self._wait_until(lambda: self._closed or len(self._ready) >= self._b)
            if len(self._ready) < self._b:
                raise QueueClosed(f"queue closed before batch {step} was complete")
            ids = sorted(list(self._ready)[: self._b])
        batch = [self._ready.pop(g) for g in ids]
        for g in ids:
            self._state[g] = CONSUMED
        self._consumed += len(ids)
        self._next_step += 1
        self._notify()
        return batch

    async def wait_drained(self, version: int) -> None:
        """Block until every group with ``v(g) <= version`` has finished (ready, consumed or
        rejected), including groups not leased yet.

        Raises:
            QueueClosed: the queue was closed first.
        """
        # Backpressure: version+1 may go live only once no group of version <= `version` can
        # still be generating, so a token's version is a function of its group id.
        await self._wait_until(lambda: self._closed or self._drained(version))
        if not self._drained(version):
            raise QueueClosed(f"queue closed before version {version} drained")

    async def set_version(self, version: int) -> None:
        """Announce that policy ``version`` is live on every server; admits the groups it allows.

        Raises:
            ValueError: ``version`` goes backwards, or (deterministic mode) groups of an older
                version are still running: call ``wait_drained(version - 1)`` first.
        """
        if version < self._version:
            raise ValueError(f"set_version({version}) goes back from version {self._version}")
        if self.mode == "deterministic" and version > self._version:
            if not self._drained(version - 1):
                raise ValueError(
                    f"set_version({version}) while groups of version {version - 1} are still "
                    f"generating; call wait_drained({version - 1}) first"
                )
        self._version = version
        self._notify()

    async def peek_ready(self, below: int) -> list[Trajectory]:
        """The ready (finished, unconsumed) groups with id ``< below``, sorted by id; nothing
        changes state. The trainer saves them with a checkpoint (see ``restored``)."""
        return [self._ready[g] for g in sorted(self._ready) if g < below]

    async def close(self) -> None:
        """Close the queue (idempotent) and wake every blocked caller."""
        self._closed = True
        self._notify()

    # ---- inspection ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def stats(self) -> QueueStats:
        """A consistent snapshot of the counters (no await inside; ``async`` as ``QueueClient.stats``,
        see ``interface.py``)."""
        return QueueStats(
            version=self._version,
            leased=self._next_id - self._first_id,
            running=len(self._holder),
            ready=len(self._ready),
            consumed=self._consumed,
            rejected=len(self._reasons),
            accepted=self._accepted,
            capacity=self._admissible(),
            next_step=self._next_step,
            closed=self._closed,
            requeued=len(self._requeued),
            released=self._released,
            worker_restarts=self._worker_restarts,
            server_failures=self._server_failures,
            server_restarts=self._server_restarts,
        )

    async def check_accounting(self) -> QueueStats:
        """``stats()``, after checking it against every group's state: each id from the first
        one up to the allocator is in exactly one state, the counters equal the number of groups
        in each state, and the invariant of ``QueueStats.check`` holds.

        Raises:
            AccountingError: they disagree; the message names the counts.
        """
        s = await self.stats()
        counts = {st: 0 for st in (RUNNING, READY, CONSUMED, REJECTED, REQUEUED)}
        for st in self._state.values():
            counts[st] += 1
        ids = set(range(self._first_id, self._next_id))
        want = {RUNNING: s.running, READY: s.ready, CONSUMED: s.consumed, REJECTED: s.rejected,
                REQUEUED: s.requeued}
        odd = sorted(ids ^ set(self._state))
        if counts != want or odd:
            raise AccountingError(
                f"queue accounting broken: counters {want} but groups by state {counts} (leased "
                f"{s.leased})" + (f"; ids {odd[:10]} are missing or unexpected" if odd else ""))
        s.check()
        return s

    def accounting(self) -> dict[int, str]:
        """State of every group leased since start: ``running`` | ``ready`` | ``consumed`` |
        ``rejected: <reason>`` | ``requeued`` (its worker died, not leased again yet)."""
        return {
            g: f"{REJECTED}: {self._reasons[g]}" if s == REJECTED else s
            for g, s in self._state.items()
        }

    # ---- internals -----------------------------------------------------------------------

    def _admissible(self) -> int:
        cap = admission_capacity(
            self._version, self._accepted, len(self._holder), self._b, self._eta,
            self._max_concurrent,
        )
        if self.mode == "deterministic":
            # Ids whose v(g) is newer than the live version wait: their tokens must all come
            # from v(g) exactly. Requeued ids were admitted under the live version (set_version
            # waits for them, see _drained), so they may always go again.
            fresh = group_id_limit(self._version, self._b, self._eta) - self._next_id
            cap = min(cap, len(self._requeued) + max(0, fresh))
        return max(0, cap)

    def _drained(self, version: int) -> bool:
        limit = group_id_limit(version, self._b, self._eta) if version >= 0 else 0
        return (self._next_id >= limit and all(g >= limit for g in self._holder)
                and all(g >= limit for g in self._requeued))

    def _expect_running(self, g: int, action: str) -> None:
        state = self._state.get(g)
        if state != RUNNING:
            raise ValueError(
                f"{action} of group {g}, which is {state or 'not leased'}; only a running "
                f"(leased, unfinished) group can be passed to {action}"
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()
