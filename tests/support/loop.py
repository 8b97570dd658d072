"""Letting one event loop run what is ready, for concurrency tests that read "still blocked"
without wall-clock waits: a task is still blocked when it is not done after ``settle()``."""

from __future__ import annotations

import asyncio


async def settle():
    """Yield to the loop 20 times: every ready callback runs, and the callbacks they make ready
    (a short chain), in no wall-clock time."""
    for _ in range(20):
        await asyncio.sleep(0)
