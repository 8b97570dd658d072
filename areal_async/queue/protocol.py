"""Wire format of the replay-queue service: length-prefixed msgpack frames of small messages.

A frame is a 4-byte big-endian payload length followed by one msgpack-encoded message. Requests
and replies are tagged unions (field ``op``); each request carries a client-chosen ``rid`` that
its reply echoes, so one connection can have many calls in flight (a worker blocks in ``lease``
while its group tasks ``submit``).
"""

from __future__ import annotations

import asyncio

import msgspec

from areal_async.queue.core import QueueStats
from areal_async.types import Trajectory

MAX_FRAME_BYTES = 1 << 30  # a batch of trajectories is far smaller; anything larger is corrupt


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", tag=str.lower):
    rid: int


# ---- requests (client → queue) -------------------------------------------------------------


class Lease(_Msg):
    worker_id: int
    max_groups: int


class Submit(_Msg):
    traj: Trajectory


class Reject(_Msg):
    group_id: int
    reason: str


class GetBatch(_Msg):
    step: int


class SetVersion(_Msg):
    version: int


class WaitDrained(_Msg):
    version: int


class GetStats(_Msg):
    check: bool = False  # check the accounting first (ReplayQueue.check_accounting)


class Release(_Msg):
    """Worker ``worker_id`` is gone: its running groups go back to be leased again."""

    worker_id: int
    restart: bool = False


class Close(_Msg):
    pass


class PeekReady(_Msg):
    below: int


Request = (Lease | Submit | Reject | GetBatch | SetVersion | WaitDrained | GetStats | Close | PeekReady
           | Release)


# ---- replies (queue → client) --------------------------------------------------------------


class Ack(_Msg):
    pass


class Leased(_Msg):
    group_ids: list[int]


class Released(_Msg):
    group_ids: list[int]


class Batch(_Msg):
    trajectories: list[Trajectory]


class Stats(_Msg):
    stats: QueueStats


class Error(_Msg):
    """A call failed. ``kind``: ``ValueError`` (misuse), ``QueueClosed``, ``AccountingError``
    (a group lost or counted twice) or ``internal``."""

    kind: str
    message: str


Reply = Ack | Leased | Released | Batch | Stats | Error


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """Read one frame's payload.

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection (cleanly between frames
            when ``.partial`` is empty).
        ValueError: a length prefix over ``MAX_FRAME_BYTES`` (a corrupt or foreign stream).
    """
    header = await reader.readexactly(4)
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}; not a queue peer?")
    return await reader.readexactly(size)


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Queue one frame on ``writer`` (the caller drains)."""
    writer.write(len(payload).to_bytes(4, "big"))
    writer.write(payload)
