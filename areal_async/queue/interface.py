"""The replay queue as its users see it, ``TrainerQueue`` and ``WorkerQueue``: both met, call for
call, by ``core.ReplayQueue`` (which documents each call) and ``client.QueueClient``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from areal_async.queue.core import QueueStats
from areal_async.types import Trajectory


@runtime_checkable
class WorkerQueue(Protocol):
    """What a generation worker calls (``rollout.worker.GenerationWorker``)."""

    async def lease(self, worker_id: int, max_groups: int) -> list[int]:
        """When the worker has free slots: up to ``max_groups`` new group ids; blocks until one is
        admitted; ``[]`` once the queue is closed (the worker then stops)."""
        ...

    async def submit(self, traj: Trajectory) -> None:
        """When a leased group's last sample is scored: hand it in (running → ready)."""
        ...


@runtime_checkable
class TrainerQueue(Protocol):
    """What the trainer's rank 0 calls (``trainer.coordinator.Coordinator``), once per step unless
    said otherwise."""

    async def get_batch(self, step: int) -> list[Trajectory]:
        """At the start of step ``step``: its batch, sorted by group id; blocks until complete."""
        ...

    async def stats(self) -> QueueStats:
        """While waiting for a batch (every second, progress display): a snapshot of the counters."""
        ...

    async def wait_drained(self, version: int) -> None:
        """Deterministic mode, before ``set_version(version + 1)``: blocks until every group of
        ``v(g) <= version`` has finished."""
        ...

    async def peek_ready(self, below: int) -> list[Trajectory]:
        """Deterministic mode, on a checkpoint step after ``wait_drained``: the ready groups of id
        ``< below``, which the checkpoint saves (nothing changes state)."""
        ...

    async def set_version(self, version: int) -> None:
        """After the weights of ``version`` are live on every server: announce it."""
        ...

    async def check_accounting(self) -> QueueStats:
        """When logging a step: ``stats()`` after checking them against every group's state
        (raises ``AccountingError``)."""
        ...

    async def close(self) -> None:
        """After the last step: close the queue (workers' leases then return ``[]``)."""
        ...
