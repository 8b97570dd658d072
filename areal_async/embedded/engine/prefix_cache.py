"""The embedded engine's prefix cache: recent token sequences whose keys and values later prompts reuse.

SGLang's radix cache (Zheng et al. 2024, §3), simplified: one sequence per dedicated KV row
(``KVCache.prefix_rows``), matched by longest common prefix (a linear scan), evicted least
recently used; no tree, no pages. A sequence is a computed prompt, or a finished request's prompt
and the output tokens whose keys and values were written (``StepPipeline._save_leaving``), so an
episode's next turn, whose prompt extends its previous turn's, finds that turn's keys and values.
Every entry carries the weight version its keys and values were computed under, and ``match``
only returns entries of the version asked for: KV of version v is never reused at another version,
whatever flushes happen (the engine also ``clear``s on every weight update and ``/flush_cache``,
which frees the rows). An insert that extends idle entries of its version takes the first one's
row and drops the others (a turn replaces the episode's earlier turns). ``PrefixCache`` is the
host-side index; the engine copies the rows. Why, and what it saves:
docs/engine.md#prompt-reuse-decision-and-measurements-the-cpu-quickstart.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)
class Entry:
    """One cached sequence: its tokens ``[n] int64`` hold keys and values in KV row ``row``,
    computed under weight version ``version``.

    ``plan`` is the scheduler step whose forward pass fills it (a step can only read an entry once
    that pass has run); ``used`` the last step that inserted or read it (the LRU clock, and the
    pin: an entry a step uses is never replaced by that step)."""

    row: int
    tokens: np.ndarray
    plan: int
    used: int
    version: int


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

    def match(self, tokens: np.ndarray, version: int) -> tuple[Entry | None, int]:
        """The entry of weight version ``version`` sharing the longest prefix with ``tokens``
        (``[n] int64``) and that length (``0 .. n``; ``(None, 0)`` when none shares a first
        token). Ties: the earliest inserted. Entries of other versions are never returned."""
        best, best_len = None, 0
        for entry in self._entries:
            if entry.version != version:
                continue
            k = min(len(entry.tokens), len(tokens))
            diff = np.flatnonzero(entry.tokens[:k] != tokens[:k])
            length = int(diff[0]) if diff.size else k
            if length > best_len:
                best, best_len = entry, length
        return best, best_len

    def insert(self, tokens: np.ndarray, plan: int, version: int) -> Entry | None:
        """Reserve a row for ``tokens``, computed under weight version ``version`` (the caller
        copies their keys and values into it once its step has computed them). Entries of that
        version whose tokens are a prefix of ``tokens`` and that step ``plan`` does not use are
        dropped (any lookup finds at least as long a prefix in the new one) and the first one's row
        taken; else a free row, else the least recently used entry not used by step ``plan`` is
        replaced; ``None`` when every entry is in use by this step."""
        idle = [e for e in self._entries if e.used < plan]
        extended = [e for e in idle if e.version == version and len(e.tokens) <= len(tokens)
                    and np.array_equal(e.tokens, tokens[:len(e.tokens)])]
        if extended:
            for e in extended:
                self._entries.remove(e)
            row = extended[0].row
            self._free.extend(e.row for e in extended[1:])
        elif self._free:
            row = self._free.pop()
        else:
            if not idle:
                return None
            oldest = min(idle, key=lambda e: e.used)
            self._entries.remove(oldest)
            row = oldest.row
        entry = Entry(row, tokens, plan, plan, version)
        self._entries.append(entry)
        return entry

    def clear(self) -> None:
        """Forget every entry (the rows' contents are overwritten by later inserts)."""
        self._free.extend(e.row for e in self._entries)
        self._entries = []
