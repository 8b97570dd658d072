"""CPU and GPU lists in Linux's notation (``"0"``, ``"0-3,8"``), divided among processes.

- ``parse_list``: the sorted indices a list names (``"0-3,8"`` → ``(0, 1, 2, 3, 8)``);
  ``format_list``: the reverse, ranges folded (``(0, 1, 2, 3, 8)`` → ``"0-3,8"``).
- ``divide``: a list cut into ``n`` equal consecutive parts, one per process (server, trainer rank).
- ``pin_rank``: a trainer rank pins itself to its part of ``RANK_CPUS_ENV`` (``LOCAL_RANK``'s);
  torchrun starts the ranks, so the launcher cannot pin each one itself.

Pure functions of their arguments, except ``pin_rank``, which sets this process's affinity. What
the launcher places where: ``launcher/placement.py``; the keys: docs/running.md#placement.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# the launcher gives torchrun each local rank's CPUs, separated by ";" (rank 0's first)
RANK_CPUS_ENV = "AREAL_ASYNC_RANK_CPUS"


def parse_list(key: str, text: str) -> tuple[int, ...]:
    """The sorted, distinct indices that ``text`` names (comma-separated indices and ``a-b``
    ranges, both ends included); ``""`` names none.

    Raises:
        ValueError: not such a list, or a range whose end is below its start; names ``key``.
    """
    found: set[int] = set()
    for item in text.replace(" ", "").split(",") if text.strip() else ():
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{key}={text!r}: {item!r} is no index or range; give a list in Linux's "
                             f"notation, such as \"0\", \"0-3\" or \"0-3,8\"")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"{key}={text!r}: the range {item!r} ends below its start; write it as "
                             f"\"{hi}-{lo}\"")
        found.update(range(lo, hi + 1))
    return tuple(sorted(found))


def format_list(indices) -> str:
    """``indices`` in Linux's notation, consecutive runs as ranges: ``(0, 1, 2, 5)`` → ``"0-2,5"``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def divide(key: str, indices: tuple[int, ...], n: int, what: str) -> list[tuple[int, ...]]:
    """``indices`` cut in order into ``n`` equal parts, the i-th for ``what`` i.

    Raises:
        ValueError: ``len(indices)`` is not a multiple of ``n``; names ``key`` and the fix.
    """
    if len(indices) % n:
        raise ValueError(f"{key}={format_list(indices)!r} names {len(indices)} CPU(s), which cannot be divided "
                         f"equally among {n} {what}; give a multiple of {n} CPUs")
    size = len(indices) // n
    return [indices[i * size:(i + 1) * size] for i in range(n)]


def pin_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """Pin this process (and the threads it starts afterwards) to its local rank's part of
    ``environ[RANK_CPUS_ENV]``; the CPUs pinned to, ``()`` when the variable is unset."""
    parts = environ.get(RANK_CPUS_ENV, "")
    if not parts:
        return ()
    mine = parse_list(RANK_CPUS_ENV, parts.split(";")[int(environ.get("LOCAL_RANK", "0"))])
    os.sched_setaffinity(0, mine)
    return mine
