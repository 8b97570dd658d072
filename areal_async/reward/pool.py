"""Reward functions by name, and the process pool that runs them with a per-call timeout.

A reward function is a plain top-level function ``fn(response: str, gold: str) -> float``
returning 1.0 (correct) or 0.0 (wrong). ``REWARD_FNS`` maps the names that tasks use
(``Task.reward_fn``) to them; registering one is one line: ``REWARD_FNS["name"] = fn``.

``RewardPool`` keeps ``num_procs`` worker processes (``spawn``), each serving one call at a
time over a pipe. The function itself travels pickled by reference, so any importable function
works, registered or not. A call that raises, or runs past ``timeout_s`` (the process is then
killed and replaced, so a runaway sympy simplification cannot wedge the pool), scores as wrong and
is counted. Scaling: ``reward = correct if value > 0.5 else wrong``, plus ``format_bonus`` when
the response has a non-empty ``\\boxed{}``.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import multiprocessing.connection
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from areal_async.config import RewardConfig
from areal_async.reward.math import extract_boxed, math_reward

RewardFn = Callable[[str, str], float]

REWARD_FNS: dict[str, RewardFn] = {"math": math_reward}

STARTUP_TIMEOUT_S = 120.0  # a spawned process imports torch-free modules only; generous on 2 cores


def resolve_reward_fn(fn: str | RewardFn) -> RewardFn:
    """A reward function from a ``REWARD_FNS`` name, a ``module:function`` path, or itself.

    Raises:
        ValueError: unknown name, or an import path that does not import (names the fix).
    """
    if callable(fn):
        return fn
    if fn in REWARD_FNS:
        return REWARD_FNS[fn]
    module, sep, attr = fn.partition(":")
    if not sep:
        raise ValueError(f"unknown reward function '{fn}'; registered: {sorted(REWARD_FNS)}, "
                         f"or give an import path 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward function '{fn}' does not import ({exc}); the module must be "
                         f"importable from the working directory or PYTHONPATH") from None


class RewardResult(msgspec.Struct, frozen=True):
    """Outcome of one scored response.

    Fields:
        reward: scaled reward (``RewardConfig.correct``/``wrong`` + format bonus).
        correct: the function returned > 0.5.
        error: the function raised or timed out (scored as wrong).
        boxed: the response has a non-empty ``\\boxed{}``.
    """

    reward: float
    correct: bool
    error: bool
    boxed: bool


def _serve(conn: mp.connection.Connection) -> None:
    """Worker process loop: receive ``(fn, response, gold)``, reply ``(status, value)``."""
    import areal_async.reward.math  # noqa: F401  (warm the default verifier's imports)
    import math_verify  # noqa: F401

    conn.send(("ready", None))
    while True:
        try:
            fn, response, gold = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # e.g. the function's module cannot be imported here
            conn.send(("error", f"cannot load the reward function: {exc!r}"))
            continue
        try:
            conn.send(("ok", float(fn(response, gold))))
        except Exception as exc:
            conn.send(("error", repr(exc)))


class _Proc:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="reward")
        self.proc.start()
        child.close()
        self.ready = False
        self.killed = False

    def call(self, fn: RewardFn, response: str, gold: str, timeout_s: float) -> tuple[str, object]:
        """Blocking (runs in a thread): ``("ok", float)`` | ``("error", str)`` |
        ``("timeout", None)``."""
        try:
            if not self.ready:
                if not self._wait(STARTUP_TIMEOUT_S):
                    return "error", f"reward process not ready within {STARTUP_TIMEOUT_S} s"
                self.conn.recv()
                self.ready = True
            self.conn.send((fn, response, gold))
            if not self._wait(timeout_s):
                return "timeout", None
            return self.conn.recv()
        except (EOFError, OSError) as exc:  # the process died (crash, OOM kill, kill())
            return "error", f"reward process died: {exc!r}"

    def _wait(self, timeout_s: float) -> bool:
        """Wait for a message in 50 ms slices, so that ``kill()`` from the event loop ends the
        wait promptly whatever happens to the pipe. False on timeout or kill."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if self.killed or time.monotonic() > deadline:
                return False
        return not self.killed

    def kill(self) -> None:
        """Kill the process. The pipe is left to the garbage collector: closing it here could
        hand its descriptor number to a new pipe while a thread still polls it."""
        self.killed = True
        self.proc.kill()
        self.proc.join()


class RewardPool:
    """Scores responses in worker processes; use as a context manager or call ``close()``.

    Args:
        cfg: ``correct``, ``wrong``, ``format_bonus``, ``timeout_s`` (per call, counted from
            the moment a process takes the call), ``num_procs``.

    Raises:
        ValueError: ``num_procs < 1``, ``timeout_s <= 0``, or ``cfg.fn`` does not resolve.
    """

    def __init__(self, cfg: RewardConfig):
        if cfg.num_procs < 1 or cfg.timeout_s <= 0:
            raise ValueError(f"reward.num_procs ({cfg.num_procs}) must be >= 1 and "
                             f"reward.timeout_s ({cfg.timeout_s}) > 0")
        self._cfg = cfg
        self._fn = resolve_reward_fn(cfg.fn) if cfg.fn else None
        self._ctx = mp.get_context("spawn")
        self._procs = [_Proc(self._ctx) for _ in range(cfg.num_procs)]
        self._idle: asyncio.Queue[_Proc] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = ThreadPoolExecutor(cfg.num_procs, thread_name_prefix="reward")
        self.calls = 0
        self.errors = 0
        self.timeouts = 0

    async def score(self, fn: str | RewardFn, response: str, gold: str) -> RewardResult:
        """Score one response against ``gold`` with ``fn`` (a ``REWARD_FNS`` name or function).

        Never raises for a failing reward function (scored wrong, counted in ``errors`` /
        ``timeouts``).

        Raises:
            ValueError: ``fn`` is an unknown name (lists the registered ones).
        """
        fn = self._fn or resolve_reward_fn(fn)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or a new event loop (the old one is done)
            self._loop, self._idle = loop, asyncio.Queue()
            for proc in self._procs:
                self._idle.put_nowait(proc)
        # Backpressure: at most num_procs verifications run at once; the rest wait for a process.
        proc = await self._idle.get()
        try:
            status, value = await loop.run_in_executor(
                self._threads, proc.call, fn, response, gold, self._cfg.timeout_s)
            if status == "timeout":
                proc = self._replace(proc)  # it is still inside the call: kill it, start afresh
        except BaseException:  # cancelled mid-call: the process state is unknown, replace it
            proc = self._replace(proc)
            raise
        finally:
            self._idle.put_nowait(proc)
        self.calls += 1
        if status == "timeout":
            self.timeouts += 1
        elif status == "error":
            self.errors += 1
        correct = status == "ok" and value > 0.5
        boxed = bool(extract_boxed(response))
        reward = (self._cfg.correct if correct else self._cfg.wrong)
        reward += self._cfg.format_bonus if boxed else 0.0
        return RewardResult(reward=reward, correct=correct, error=status != "ok", boxed=boxed)

    def stats(self) -> dict[str, float]:
        """Counters since start: ``reward/calls``, ``reward/errors``, ``reward/timeouts``."""
        return {"reward/calls": self.calls, "reward/errors": self.errors,
                "reward/timeouts": self.timeouts}

    def _replace(self, proc: _Proc) -> _Proc:
        proc.kill()
        fresh = _Proc(self._ctx)
        self._procs[self._procs.index(proc)] = fresh
        return fresh

    def close(self) -> None:
        """Kill the worker processes (idempotent)."""
        for proc in self._procs:
            if proc.proc.is_alive():
                proc.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
