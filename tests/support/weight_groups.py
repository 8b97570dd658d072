"""The other ranks of a gloo weight-update group, for tests of the side that
``areal_async.weight_group.new_weight_group`` builds (a server's or the trainer's).

Each is built on the store keys SGLang's ``init_custom_process_group`` uses (``<group>`` then
``<group>/`` then ``cpu/``: checked in ``tests/test_sglang_weight_group.py``), without torch's
registry of named groups, which holds one group of a name per process (the side under test's).
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from areal_async import weight_group


def peer_group(store: dist.Store, group: str, rank: int, timeout_s: float = 30.0,
               world_size: int = 2) -> dist.ProcessGroup:
    """Rank ``rank`` of the gloo group ``group`` on ``store``, at SGLang's prefixes, unregistered."""
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group}/", dist.PrefixStore(group, store)))
    return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))


def trainer_group(port: int, world_size: int = 2, group_name: str = "weight_update_group",
                  timeout_s: float = 60.0) -> dist.ProcessGroup:
    """Rank 0 (the trainer) of a gloo weight-update group that a server in this test process
    joins, hosting its store on ``port``."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s))
    return peer_group(store, group_name, 0, timeout_s, world_size)


def host_group_in_thread(port: int, group: str) -> tuple[threading.Thread, dict, dist.TCPStore]:
    """Rank 0 of a two-rank gloo weight group ``group`` joining in a thread (it hosts the store on
    ``port``), and a client of that store once it listens. Returns (the thread, the dict that gets
    ``"group"`` when rank 0 has joined, the store)."""
    joined: dict = {}
    trainer = threading.Thread(target=lambda: joined.update(group=weight_group.new_weight_group(
        "gloo", "127.0.0.1", port, 0, 2, timeout_s=30, group_name=group)), daemon=True)
    trainer.start()
    deadline = time.monotonic() + 20
    while True:  # rank 0 hosts the store: connect once it listens
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
            return trainer, joined, store
        except (RuntimeError, dist.DistError):
            assert time.monotonic() < deadline, "rank 0 does not host the store"
            time.sleep(0.05)
