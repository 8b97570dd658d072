"""A wall-clock limit on each call into a user's environment (``rollout.env_timeout_s``).

An ``async`` call runs in a task of its own; past the limit it is cancelled and ``EnvTimeout`` is
raised once it ends. A call that ignores its cancellation (a bare ``except:`` around an ``await``)
gets ``GRACE_S`` more seconds, then ``EnvTimeout`` is raised without it: its task is cancelled
again, and that time the call is closed (``GeneratorExit`` at its ``await``) instead of resumed, so
neither the episode nor the event loop's shutdown waits for it. A call that blocks the event loop
(a synchronous method, or a synchronous call inside an ``async`` one) cannot be interrupted: a
watchdog thread sees when it started and, once it is past the limit while holding the loop,
prints the message to stderr and ends the process with status 1. Either way the launcher reports
the worker's death with its last lines.

A call given a ``ModelClock`` (an agent's ``run``, whose model calls the clock times) is limited in
its own time: the wall time since it started less the time during which at least one of its model
calls was in flight. A stretch in which the call holds the event loop counts as its own."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

HOLD_S = 1.0  # an overdue call is ended once it has held the loop this long (or its limit, if less)
GRACE_S = 1.0  # a cancelled call that has not ended this long after its limit is abandoned
_IGNORED: list = []  # abandoned calls that ignored GeneratorExit too (one per such call, never resumed)


class EnvTimeout(TimeoutError):
    """An environment call ran past ``rollout.env_timeout_s``."""


class ModelClock:
    """Times an episode's model calls: ``busy_s`` is the seconds during which at least one was in
    flight (overlapping calls counted once), ``in_flight`` how many are in flight now. Written on
    the event loop's thread; read from any (one state tuple, replaced whole)."""

    def __init__(self):
        self._state = (0, 0.0, 0.0)  # (calls in flight, when the current busy stretch began, seconds before it)

    @property
    def in_flight(self) -> int:
        return self._state[0]

    def busy_s(self, now: float | None = None) -> float:
        """Seconds with a call in flight up to ``now`` (default: the monotonic clock's now)."""
        n, since, done = self._state
        return done + (max(0.0, (time.monotonic() if now is None else now) - since) if n else 0.0)

    @contextlib.contextmanager
    def call(self):
        """Marks a model call in flight for the block's duration."""
        n, since, done = self._state
        self._state = (n + 1, time.monotonic() if not n else since, done)
        try:
            yield
        finally:
            n, since, done = self._state
            if n == 1:  # the busy stretch ends
                done += time.monotonic() - since
            self._state = (n - 1, since, done)


def overrun_message(what: str, where: str, limit_s: float, elapsed_s: float, model_s: float | None = None) -> str:
    """What a call past the limit is reported with: ``what`` (``Class.method``), ``where`` (the
    episode and turn), the limit and the key that sets it; ``model_s``: how much of ``elapsed_s``
    its model calls were in flight (not counted)."""
    model = ("" if model_s is None else f"{round(model_s, 1):g} s of it with a model call in flight, which "
                                        f"the limit does not count; ")
    return (f"{what} has run {round(elapsed_s, 1):g} s in {where} (rollout.env_timeout_s={limit_s:g}); "
            f"{model}make it return sooner, or raise rollout.env_timeout_s (0: no limit)")


async def call_env(fn: Callable[..., Any], args: tuple, what: str, where: str, limit_s: float,
                   model_clock: ModelClock | None = None) -> Any:
    """``fn(*args)``, awaited if it returns an awaitable, within ``limit_s`` seconds (0: no limit)
    of its own time: with ``model_clock``, the time its model calls were in flight is not counted.

    Raises:
        EnvTimeout: an awaitable not done within the limit (cancelled; abandoned if it ignores
            the cancellation for ``GRACE_S`` seconds).
        What ``fn`` raises. A call that blocks the event loop past the limit ends the process.
    """
    if not limit_s:
        out = fn(*args)
        return await out if inspect.isawaitable(out) else out
    call = _Call(what, where, limit_s, model_clock)
    _WATCHDOG.watch(call)
    try:
        out = fn(*args)
    except BaseException:
        _WATCHDOG.unwatch(call)
        raise
    call.held = None
    if not inspect.isawaitable(out):
        _WATCHDOG.unwatch(call)
        return out
    return await _limited(out, call)


async def _limited(out, call: _Call) -> Any:
    """``await out`` in a task of its own, watched until it ends. Past the limit (looked at again
    each time what was left of it has passed: model time stops its own) the task is cancelled;
    past ``GRACE_S`` more, cancelled again (``_marked`` then closes the call) and left.

    Raises:
        EnvTimeout: past the limit, whether the call ended in the grace or not.
    """
    task = asyncio.ensure_future(_drive(out, call))
    task.add_done_callback(_retrieved)
    task.add_done_callback(lambda _: _WATCHDOG.unwatch(call))
    expired = False
    try:
        while not task.done():
            left = call.limit_s - call.own_s(time.monotonic())
            if left <= 0:
                expired = True
                task.cancel()
                await asyncio.wait([task], timeout=GRACE_S)
                break
            await asyncio.wait([task], timeout=left)  # its own time grows no faster than the wall's
    finally:
        if not task.done():  # it ignored the cancellation (or the caller was cancelled): cancel it again
            task.cancel()
    if not expired:
        return task.result()
    message = call.overrun(time.monotonic())
    if not task.done():
        message += (f"; it ignored its cancellation for {GRACE_S:g} s (an except that catches "
                    f"asyncio.CancelledError and goes on: a bare except, or except BaseException) and was "
                    f"abandoned; let CancelledError propagate")
    raise EnvTimeout(message)


async def _drive(out, call: _Call) -> Any:
    return await _marked(out, call)


def _retrieved(task: asyncio.Task) -> None:
    """Marks a task's exception as retrieved (an abandoned call's, or one raised after its limit)."""
    if not task.cancelled():
        task.exception()


class _Call:
    """A watched call; ``held``: ``(when, model seconds then)`` as the event loop's thread last
    entered it (``None``: it is not running now), one tuple so that the watchdog reads both at once."""

    def __init__(self, what: str, where: str, limit_s: float, clock: ModelClock | None = None):
        self.what, self.where, self.limit_s, self.clock = what, where, limit_s, clock
        self.start = time.monotonic()
        self.busy0 = self.busy(self.start)
        self.held: tuple[float, float] | None = (self.start, self.busy0)

    def busy(self, now: float) -> float:
        """The clock's model seconds at ``now`` (0 without a clock)."""
        return 0.0 if self.clock is None else self.clock.busy_s(now)

    def model_s(self, now: float, held: tuple[float, float] | None = None) -> float:
        """Seconds since its start with a model call in flight; while it holds the loop (``held``),
        those up to when it took it: the time since is its own."""
        return (held[1] if held is not None else self.busy(now)) - self.busy0

    def own_s(self, now: float, held: tuple[float, float] | None = None) -> float:
        """Seconds since its start that count against its limit."""
        return now - self.start - self.model_s(now, held)

    def overrun(self, now: float, held: tuple[float, float] | None = None) -> str:
        """``overrun_message`` of it at ``now``, its model time named where it has a clock."""
        return overrun_message(self.what, self.where, self.limit_s, now - self.start,
                               None if self.clock is None else self.model_s(now, held))

    def next_look(self, now: float) -> float | None:
        """When the watchdog should look at it again; ``None``: end the process now."""
        held = self.held
        hold = min(self.limit_s, HOLD_S)
        own = self.own_s(now, held)
        if own < self.limit_s:
            return now + self.limit_s - own  # its own time grows no faster than the wall's
        if held is None:  # awaiting, or being cancelled: _limited cancels it, then abandons it
            return now + hold
        return None if now - held[0] >= hold else held[0] + hold


@types.coroutine
def _marked(awaitable, call: _Call):
    """``await awaitable``, with ``call.held`` set while the loop's thread runs it. A
    cancellation is passed on to it; one after a cancellation it went on from closes it instead
    (``GeneratorExit`` at its ``await``) and is raised here, so that it cannot outlive its task."""
    it = awaitable.__await__()
    value, error, ignored = None, None, False
    while True:
        now = time.monotonic()
        call.held = (now, call.busy(now))
        try:
            if error is not None and ignored:
                try:
                    it.close()
                except RuntimeError:  # "coroutine ignored GeneratorExit": it cannot be ended; kept, not
                    _IGNORED.append(awaitable)  # collected, where a second close would print the error
                raise error
            yielded = it.send(value) if error is None else it.throw(error)
            ignored = ignored or error is not None
        except StopIteration as stop:
            return stop.value
        finally:
            call.held = None
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            it.close()
            raise
        except BaseException as exc:  # a cancellation, passed on to the call
            value, error = None, exc


class _Watchdog:
    """A daemon thread that ends the process when a watched call blocks the loop past its limit."""

    def __init__(self):
        self._cond = threading.Condition()
        self._calls: set[_Call] = set()
        self._thread: threading.Thread | None = None

    def watch(self, call: _Call) -> None:
        with self._cond:
            self._calls.add(call)
            if self._thread is None or not self._thread.is_alive():  # none yet, or a forked child
                self._thread = threading.Thread(target=self._run, name="env-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def unwatch(self, call: _Call) -> None:
        with self._cond:
            self._calls.discard(call)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                looks = {call: call.next_look(now) for call in self._calls}
                blocked = [call for call, at in looks.items() if at is None]
                if not blocked:
                    self._cond.wait(min(looks.values()) - now if looks else None)
                    continue
                call = blocked[0]
                print(f"[env-watchdog] {call.overrun(now, call.held)}; "
                      f"it blocks this process's event loop, so the process is ended", file=sys.stderr, flush=True)
                # os._exit, not an exception or sys.exit: the blocked call holds the only thread that
                # could raise, and a normal exit would wait for that thread and for exit handlers
                os._exit(1)


_WATCHDOG = _Watchdog()
