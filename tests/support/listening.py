"""The TCP sockets a process listens on, read from ``/proc`` (Linux): for the loopback-only tests."""

from __future__ import annotations

import ipaddress
import os
import pathlib
import socket

import pytest

needs_proc = pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
_LISTEN = "0A"  # the TCP_LISTEN state in /proc/net/tcp*


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)  # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of each TCP socket process ``pid`` listens on, e.g. ``("::", 29500)``."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == _LISTEN and inode in inodes:
                address, port = local.split(":")
                found.append((_address(address), int(port, 16)))
    return found


def off_loopback(sockets: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Those not on a loopback address (``::`` and ``0.0.0.0``, every interface, included)."""
    return [(a, p) for a, p in sockets if not ipaddress.ip_address(a).is_loopback]
