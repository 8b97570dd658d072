"""Progress of the waits a user sits through (an evaluation, a step's rollouts and training).

``AREAL_ASYNC_PROGRESS`` (``bar`` | ``lines`` | ``off``; unset: ``bar`` on a terminal) picks a
``tqdm`` bar after ``delay_s`` or a line at most every ``interval_s``; an update costs a counter
increment and a clock read (docs/running.md#what-the-main-job-does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

ENV = "AREAL_ASYNC_PROGRESS"
MODES = ("bar", "lines", "off")


def progress_mode() -> str:
    """The rendering of this process (see the module doc).

    Raises:
        ValueError: ``AREAL_ASYNC_PROGRESS`` is set to something else than ``bar``, ``lines``, ``off``.
    """
    mode = os.environ.get(ENV) or ("bar" if sys.stdout.isatty() else "lines")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not a progress mode; set it to one of {list(MODES)} or unset it")
    return mode


class Progress:
    """Progress of one phase: ``with Progress("eval", 60, "prompts") as p: ... p.update()``.

    Args:
        what: what is being waited for (``"step 3/30: rollouts"``).
        total: units the phase needs, or ``None`` when not known (a count is shown).
        unit: what is counted, plural (``"prompts"``).
        mode: ``bar`` | ``lines`` | ``off``; ``None``: ``progress_mode()``.
        interval_s: ``lines``: the least seconds between two lines.
        delay_s: ``bar``: seconds before the bar first appears.
        file: where to write (stdout).
    """

    def __init__(self, what: str, total: int | None, unit: str, mode: str | None = None,
                 interval_s: float = 30.0, delay_s: float = 2.0, file=None):
        self.what, self.total, self.unit = what, total, unit
        self.mode = progress_mode() if mode is None else mode
        self.interval_s, self.delay_s, self.file = interval_s, delay_s, file or sys.stdout
        self.n = 0
        self._start = self._last_line = time.monotonic()
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, file=self.file, leave=False,
                             delay=delay_s, mininterval=0.5, dynamic_ncols=True, bar_format=self._format())

    def _format(self) -> str:
        """tqdm's bar format with the unit as a word after the count (tqdm's own glues it to the
        number and the rate: ``1micro-batches``)."""
        if self.total is None:
            return "{desc}: {n_fmt} " + self.unit + " [{elapsed}]"
        return "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " + self.unit + " [{elapsed}<{remaining}]"

    def set_total(self, total: int) -> None:
        """The units the phase needs, once known (e.g. the micro-batches of a step's plan)."""
        if total == self.total:
            return
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.bar_format = self._format()

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.set(self.n + n)

    def set(self, n: int) -> None:
        """``n`` units done in all (a count polled from elsewhere)."""
        if n == self.n:
            return
        if self._bar is not None:
            self._bar.update(n - self.n)
        self.n = n
        if self.mode == "lines":
            self.tick()

    def tick(self) -> None:
        """``lines``: write the line if ``interval_s`` has passed since the last (or the start);
        ``bar``: redraw it (its clock), once it is shown."""
        now = time.monotonic()
        if self._bar is not None and now - self._start >= self.delay_s:
            self._bar.refresh()
        if self.mode == "lines" and now - self._last_line >= self.interval_s:
            self._last_line = now
            of = f"/{self.total}" if self.total is not None else ""
            print(f"[trainer] {self.what}: {self.n}{of} {self.unit} ({now - self._start:.0f} s)",
                  file=self.file, flush=True)

    async def follow(self, poll: Callable[[], Awaitable[int]] | None = None, every_s: float = 1.0) -> None:
        """Until cancelled: every ``every_s`` seconds ``set(await poll())`` (when given) and ``tick()``,
        so a phase without updates of its own (a wait) still shows its clock. Run it as a task."""
        while True:
            await asyncio.sleep(every_s)
            if poll is not None:
                self.set(await poll())
            self.tick()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.asynccontextmanager
async def following(prog: Progress, poll: Callable[[], Awaitable[int]] | None = None) -> AsyncIterator[None]:
    """Run ``prog.follow(poll)`` as a task while the block runs (cancelled when it ends)."""
    task = asyncio.create_task(prog.follow(poll))
    try:
        yield
    finally:
        task.cancel()
