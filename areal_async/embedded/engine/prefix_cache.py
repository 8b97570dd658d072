"""The embedded engine's prefix cache: recent prompts whose keys and values later prompts reuse.

SGLang's radix cache (Zheng et al. 2024, §3), simplified: one whole prompt per dedicated KV row
(``KVCache.prefix_rows``), matched by longest common prefix (a linear scan), evicted least
recently used; no tree, no pages, no output tokens. ``PrefixCache`` is the host-side index; the
engine copies the rows, and calls ``clear`` on every weight update and ``/flush_cache``. Why, and
what it saves: docs/engine.md#prompt-reuse-decision-and-measurements-the-cpu-quickstart.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)
class Entry:
    """One cached prompt: its tokens ``[n] int64`` hold keys and values in KV row ``row``.

    ``plan`` is the scheduler step that inserted it (a step can only read an entry once the
    forward pass that fills it has run); ``used`` the last step that inserted or read it (the
    LRU clock, and the pin: an entry a step uses is never replaced by that step)."""

    row: int
    tokens: np.ndarray
    plan: int
    used: int


class PrefixCache:
    """Longest-common-prefix lookup over the prompts held in ``rows`` (KV row indices).

    Args:
        rows: the KV rows the cache may fill (``KVCache.prefix_rows``), at least one.

    Raises:
        ValueError: ``rows`` is empty.
    """

    def __init__(self, rows: list[int]):
        if not rows:
            raise ValueError("a prefix cache needs at least one KV row; give prefix_cache_entries >= 1")
        self._free = list(rows)
        self._entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: np.ndarray) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` (``[n] int64``) and that length
        (``0 .. n``; ``(None, 0)`` when no entry shares a first token). Ties: the earliest inserted."""
        best, best_len = None, 0
        for entry in self._entries:
            k = min(len(entry.tokens), len(tokens))
            diff = np.flatnonzero(entry.tokens[:k] != tokens[:k])
            length = int(diff[0]) if diff.size else k
            if length > best_len:
                best, best_len = entry, length
        return best, best_len

    def insert(self, tokens: np.ndarray, plan: int) -> Entry | None:
        """Reserve a row for ``tokens`` (the caller copies their keys and values into it once its
        step has computed them). Takes a free row, else replaces the least recently used entry not
        used by step ``plan``; ``None`` when every entry is in use by this step."""
        if self._free:
            row = self._free.pop()
        else:
            idle = [e for e in self._entries if e.used < plan]
            if not idle:
                return None
            oldest = min(idle, key=lambda e: e.used)
            self._entries.remove(oldest)
            row = oldest.row
        entry = Entry(row, tokens, plan, plan)
        self._entries.append(entry)
        return entry

    def clear(self) -> None:
        """Forget every entry (the rows' contents are overwritten by later inserts)."""
        self._free.extend(e.row for e in self._entries)
        self._entries = []
