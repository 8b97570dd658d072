"""A c10d ``TCPStore`` server that listens on one address: torch's own binds every interface whatever
``host`` says, so ``hosted_store`` binds the socket itself and hands it over as ``master_listen_fd``
(docs/configuration.md#security)."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening; IPv6 if ``host`` is an
    IPv6 address. ``SO_REUSEADDR`` as libuv sets it, so a port left in TIME_WAIT is bindable.

    Raises:
        OSError: the port is taken (``EADDRINUSE``: "Address already in use"), or ``host`` is not
            an address of this machine.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def hosted_store(host: str, port: int, world_size: int | None, timeout: datetime.timedelta, *,
                 multi_tenant: bool, wait_for_workers: bool = True) -> dist.TCPStore:
    """The server side of a ``TCPStore`` (``is_master=True``) listening on ``host:port`` only.

    Args:
        host: the address the peers are given (and the only one the store listens on).
        port: its port (0: a free one; read it back as ``store.port``).
        world_size, timeout, multi_tenant, wait_for_workers: as ``torch.distributed.TCPStore``'s.
    Raises:
        OSError: ``host:port`` cannot be bound (``listening_socket``).
        torch.distributed.DistError: ``wait_for_workers`` and the peers did not all join in time.
    """
    with listening_socket(host, port) as sock:
        # the store adopts and later closes the descriptor it is given: give it a duplicate, so
        # this socket object closes only its own
        fd = os.dup(sock.fileno())
        return dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, multi_tenant=multi_tenant, master_listen_fd=fd)
