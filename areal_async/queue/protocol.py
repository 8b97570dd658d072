"""Wire format of the replay-queue service: length-prefixed msgpack frames of small messages.

A frame is a 4-byte big-endian length, then one message; requests and replies are tagged unions
(``op``) and a reply echoes its request's ``rid``, so one connection carries many calls. With a
token the first frame must be ``Auth``. Connection errors carry ``rid = -1``: ``Unauthorized`` and
``TooLarge`` close it, ``BadRequest`` does not.
"""

from __future__ import annotations

import asyncio

import msgspec

from areal_async.queue.core import QueueStats
from areal_async.types import Trajectory

MAX_FRAME_BYTES = 1 << 30  # a reply (a batch of trajectories) is far smaller; anything larger is corrupt
CONNECTION = -1  # the rid of an Error about the connection, not one call
_JOIN_BYTES = 1 << 16  # write_frame copies a payload up to this size behind its length


class FrameTooLarge(ValueError):
    """A length prefix over the reader's limit (the payload is left unread)."""


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


class ServerFailed(_Msg):
    """The launcher found inference server ``server`` dead or hung (``restart``: it starts it again)."""

    server: int
    restart: bool = False


class Close(_Msg):
    pass


class PeekReady(_Msg):
    below: int


class Auth(_Msg):
    """The job's token; the first frame of a connection to a queue that has one."""

    token: str


Request = (Lease | Submit | Reject | GetBatch | SetVersion | WaitDrained | GetStats | Close | PeekReady
           | Release | ServerFailed | Auth)


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
    """A call failed. ``kind``: ``ValueError`` (misuse), ``QueueClosed``, ``AccountingError`` (a
    group lost or counted twice), ``internal``; or, with ``rid = CONNECTION``, ``Unauthorized``,
    ``BadRequest`` or ``TooLarge`` (module docstring)."""

    kind: str
    message: str


Reply = Ack | Leased | Released | Batch | Stats | Error


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame's payload of at most ``max_bytes``.

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection (cleanly between frames
            when ``.partial`` is empty).
        FrameTooLarge: a length prefix over ``max_bytes`` (too large a request, or a corrupt or
            foreign stream); the payload is not read.
    """
    header = await reader.readexactly(4)
    size = int.from_bytes(header, "big")
    if size > max_bytes:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes; not a queue peer, "
                            f"or raise queue.max_request_bytes")
    return await reader.readexactly(size)


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Queue one frame on ``writer`` in one call (the caller drains): one ``send`` on an idle
    socket, where writing the length and the payload apart made two.

    A payload of up to 64 KiB (``_JOIN_BYTES``) is copied behind its length and written as one
    buffer; a larger one goes through ``writelines``, which uvloop sends without a copy (and
    asyncio's own loop joins), as its copy would cost more than the call (``writelines`` costs
    about twice a ``write`` per frame under uvloop). Nothing is awaited, so writers on one
    connection need no lock to keep their frames whole.
    """
    header = len(payload).to_bytes(4, "big")
    if len(payload) <= _JOIN_BYTES:
        writer.write(header + payload)
    else:
        writer.writelines((header, payload))
