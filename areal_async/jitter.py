"""Seeded random timing jitter (``debug.jitter_ms``) for the determinism tests: each process draws
uniform ``[0, jitter_ms)`` ms delays from its own stream keyed by ``(debug.jitter_seed, stream)``."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np


class Jitter:
    """Uniform random delays of up to ``ms`` milliseconds.

    Args:
        ms: largest delay in milliseconds (``>= 0``; 0 disables).
        seed: ``debug.jitter_seed`` of the run.
        stream: names the caller (strings and ints), so processes draw independent delays.

    Raises:
        ValueError: ``ms < 0``.
    """

    def __init__(self, ms: float, seed: int, *stream: str | int):
        if ms < 0:
            raise ValueError(f"debug.jitter_ms must be >= 0, got {ms}")
        self.max_s = ms / 1000.0
        words = [int(seed)] + [zlib.crc32(s.encode()) if isinstance(s, str) else int(s) for s in stream]
        self._rng = np.random.default_rng(words)

    @property
    def enabled(self) -> bool:
        return self.max_s > 0

    def draw_s(self) -> float:
        """The next delay in seconds (0.0 when disabled)."""
        return float(self._rng.uniform(0.0, self.max_s)) if self.max_s > 0 else 0.0

    async def __call__(self) -> None:
        """Sleep the next delay (no-op when disabled)."""
        if self.max_s > 0:
            await asyncio.sleep(self.draw_s())
