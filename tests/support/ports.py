"""A free TCP port on 127.0.0.1, for a test's server, store or process group.

Free when chosen: the socket that found it is closed before the caller binds, so another process
could take it meanwhile (as with the launcher's ``launcher.ports.choose_ports``). The product's
only equivalent is private to ``areal_async/trainer/policy.py`` (``_free_port``, for its one-rank
group); the tests keep this one rather than reach into that module.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
