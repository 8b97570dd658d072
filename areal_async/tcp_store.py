"""A c10d ``TCPStore`` server that listens on one address, not on every interface.

torch's ``TCPStore(host, port, is_master=True)`` never binds ``host``: ``host`` is only where its
own client connects. Its server binds the wildcard address: the libuv backend (the default)
binds ``::`` or ``0.0.0.0`` (``UvTcpServer::makeWithPort``,
``torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp``). Measured with torch 2.13 on Linux: a store made with
``"127.0.0.1"`` listens on ``[::]:port`` (every IPv4 and IPv6 address), with ``use_libuv`` True
or False. ``TCPStore`` has no bind-address option; what it does take is ``master_listen_fd``, a
socket already bound and listening, which both backends adopt as their server socket
(``UvTcpServer::makeWithSocket``, ``uv_tcp_open``). ``hosted_store`` binds that socket to ``host``
itself, so the store listens there only (``127.0.0.1`` for the jobs of ``launcher.local``).

Used for the trainer↔server weight group (``weight_group.new_weight_group``, rank 0) and for
torchrun's static rendezvous (``launcher.torchrun``: a multi-tenant store hosted here first,
which torchrun's own ``TCPStore(..., multi_tenant=True)`` on the same port then reuses, as torch
keys multi-tenant servers by port within a process).
"""

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
