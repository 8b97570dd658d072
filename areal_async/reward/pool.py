"""The process pool that runs reward functions (``reward/fn.py``: names and forms) with a timeout.

Reward = ``correct if value > 0.5 else wrong`` (``reward.graded``: ``wrong + value * (correct -
wrong)`` for a value in [0, 1], any other an error), plus ``format_bonus`` for a non-empty
``\\boxed{}``. ``RewardPool`` keeps ``num_procs`` spawned processes, started at the first call (a
pool that scores nothing, e.g. a trainer's with no evaluation due, costs no process), each serving
one call at a time (the function travels pickled by reference: any importable one works; an answer-form call
sends the response and the gold only, a keyword-form call the arguments the function names).
Invariant: a call that fails scores as wrong and is counted, and a dead or stuck process is
replaced; deaths in a row stop the job (docs/faults.md#a-reward-function-fails).
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import multiprocessing.connection
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from areal_async.config import RewardConfig
from areal_async.reward.fn import REWARD_FNS, RewardFn, fn_name, keywords, resolve_reward_fn
from areal_async.reward.math import extract_boxed, math_reward

__all__ = ["REWARD_FNS", "RewardPool", "RewardProcessError", "RewardResult", "resolve_reward_fn"]

# a spawned process imports its parent's __main__ module and the reward function's; generous on 2 cores
STARTUP_TIMEOUT_S = 120.0


class RewardProcessError(RuntimeError):
    """The reward function's process died ``reward.max_consecutive_deaths`` times in a row."""


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from ``multiprocessing.Process.exitcode``: ``exit code 3``,
    ``signal SIGKILL`` (negative codes), or ``no exit code`` (it had not exited yet)."""
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class RewardResult(msgspec.Struct, frozen=True):
    """Outcome of one scored response.

    Fields:
        reward: scaled reward (``RewardConfig.correct``/``wrong``, or between them when graded,
            + format bonus).
        correct: the function returned > 0.5 (graded: returned 1.0).
        error: the function raised, timed out, or (graded) returned a value outside [0, 1]
            (scored as wrong).
        boxed: the response has a non-empty ``\\boxed{}``.
    """

    reward: float
    correct: bool
    error: bool
    boxed: bool


def _serve(conn: mp.connection.Connection, module: str) -> None:
    """Worker process loop: import ``module`` (the reward function's: its imports are not counted
    in the first call's timeout), then receive ``(fn, args, kwargs)``, reply ``(status, value)``."""
    try:
        if module:
            importlib.import_module(module)
        if module == math_reward.__module__:
            importlib.import_module("math_verify")  # imported by the default verifier at its first call
    except Exception:  # the first call imports it again and replies with the error
        pass
    conn.send(("ready", None))
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # e.g. the function's module cannot be imported here
            conn.send(("error", f"cannot load the reward function: {exc!r}"))
            continue
        try:
            conn.send(("ok", float(fn(*args, **kwargs))))
        except Exception as exc:
            conn.send(("error", _where(exc)))


def _where(exc: BaseException) -> str:
    """``repr(exc)`` and the innermost frame it was raised in (``file:line in function``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{exc!r} at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" \
        if frames else repr(exc)


class _Proc:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx, module: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, module), daemon=True, name="reward")
        self.proc.start()
        child.close()
        self.ready = False
        self.killed = False

    def call(self, fn: RewardFn, args: tuple, kwargs: dict, timeout_s: float) -> tuple[str, object]:
        """Blocking (runs in a thread): ``("ok", float)`` | ``("error", str)`` |
        ``("timeout", None)`` | ``("died", exitcode)`` (the process ended: its pipe closed) |
        ``("stuck", str)`` (not ready within ``STARTUP_TIMEOUT_S``: e.g. an import that hangs)."""
        try:
            if not self.ready:
                if not self._wait(STARTUP_TIMEOUT_S):
                    return "stuck", f"reward process not ready within {STARTUP_TIMEOUT_S} s"
                self.conn.recv()
                self.ready = True
            self.conn.send((fn, args, kwargs))
            if not self._wait(timeout_s):
                return "timeout", None
            return self.conn.recv()
        except (EOFError, OSError):  # the process died (crash, OOM kill, sys.exit, os._exit)
            self.proc.join(5.0)  # its pipe is closed, so it has exited or is about to
            return "died", self.proc.exitcode

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
        cfg: ``correct``, ``wrong``, ``graded``, ``format_bonus``, ``timeout_s`` (per call,
            counted from the moment a process takes the call), ``num_procs``,
            ``max_consecutive_deaths``.

    Raises:
        ValueError: ``num_procs < 1``, ``timeout_s <= 0``, ``max_consecutive_deaths < 1``, or
            ``cfg.fn`` does not resolve.
    """

    def __init__(self, cfg: RewardConfig):
        if cfg.num_procs < 1 or cfg.timeout_s <= 0 or cfg.max_consecutive_deaths < 1:
            raise ValueError(f"reward.num_procs ({cfg.num_procs}) and "
                             f"reward.max_consecutive_deaths ({cfg.max_consecutive_deaths}) must "
                             f"be >= 1 and reward.timeout_s ({cfg.timeout_s}) > 0")
        self._cfg = cfg
        self._fn = resolve_reward_fn(cfg.fn) if cfg.fn else None
        # a name or function given to score() -> (the function, its keywords): resolved once
        self._resolved: dict[str | RewardFn, tuple[RewardFn, tuple[str, ...] | None]] = {}
        self._ctx = mp.get_context("spawn")
        self._procs: list[_Proc] = []  # started at the first call: a spawned child imports __main__'s modules
        self._module = ""
        self._idle: asyncio.Queue[_Proc] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = ThreadPoolExecutor(cfg.num_procs, thread_name_prefix="reward")
        self.calls = 0
        self.errors = 0
        self.timeouts = 0
        self.restarts = 0  # processes replaced after dying (timeouts are counted apart)
        self._reported: set[str] = set()  # failure kinds printed once: error, timeout, range
        self._deaths_in_a_row = 0

    async def score(self, fn: str | RewardFn, response: str, gold: str,
                    prompt: list[dict[str, Any]] | None = None,
                    item: dict[str, Any] | None = None) -> RewardResult:
        """Score one response against ``gold`` with ``fn`` (a ``REWARD_FNS`` name or function);
        ``reward.fn``, when set, replaces ``fn``. A keyword-form function also gets, as it names
        them, ``messages`` (``prompt``, the chat turns the response answers, then the response as
        the assistant's turn) and ``item`` (the item's row; ``None``: ``{}``).

        A call whose process dies is retried once on a fresh process; if that one dies too it
        scores as an error. Otherwise a failing reward function never raises (scored wrong,
        counted in ``errors`` / ``timeouts``).

        Raises:
            ValueError: ``fn`` is an unknown name (lists the registered ones) or of neither form.
            RewardProcessError: the pool's processes died ``max_consecutive_deaths`` times in a
                row (names the function and the last exit code or signal).
        """
        fn, names = self._resolve(self._fn or fn)
        args, kwargs = self._arguments(names, response, gold, prompt, item)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or a new event loop (the old one is done)
            if not self._procs:
                self._module = fn.__module__  # what each process imports before its first call
                for _ in range(self._cfg.num_procs):  # appended one by one: close() kills what started
                    self._procs.append(_Proc(self._ctx, self._module))
            self._loop, self._idle = loop, asyncio.Queue()
            for proc in self._procs:
                self._idle.put_nowait(proc)
        # Backpressure: at most num_procs verifications run at once; the rest wait for a process.
        proc = await self._idle.get()
        try:
            for _ in range(2):  # a call whose process died is retried once, on a fresh one
                status, value = await loop.run_in_executor(
                    self._threads, proc.call, fn, args, kwargs, self._cfg.timeout_s)
                if status != "died":
                    break
                proc = self._replace(proc)
                self._count_death(fn, value)  # raises RewardProcessError at the bound
            if status == "died":  # the fresh process died on it too: this response kills it
                status, value = "error", f"reward process died ({describe_exit(value)})"
            else:
                self._deaths_in_a_row = 0
            if status in ("timeout", "stuck"):  # still inside the call or its imports: kill it, start afresh
                if status == "stuck":  # its imports hang: a fresh process imports only what a call needs
                    self._module, status = "", "error"
                proc = self._replace(proc)
        except RewardProcessError:  # the process was replaced already
            raise
        except BaseException:  # cancelled mid-call: the process state is unknown, replace it
            proc = self._replace(proc)
            raise
        finally:
            self._idle.put_nowait(proc)
        if status == "ok" and self._cfg.graded and not 0.0 <= value <= 1.0:  # NaN fails too
            status = "error"
            self._report_once("range", f"reward function {fn_name(fn)} returned {value!r}, outside "
                              f"[0, 1], with reward.graded on: scored as an error (wrong); return a "
                              f"fraction of full credit in [0, 1], or turn reward.graded off for a "
                              f"pass/fail value (> 0.5 correct)")
        elif status == "error":
            self._report_once("error", f"reward function {fn_name(fn)} failed: {value}; scored as "
                              f"an error (wrong)")
        elif status == "timeout":
            self._report_once("timeout", f"reward function {fn_name(fn)} took over reward.timeout_s "
                              f"= {self._cfg.timeout_s} s: scored wrong and its "
                              f"process replaced; raise reward.timeout_s if the verifier is slow")
        self.calls += 1
        if status == "timeout":
            self.timeouts += 1
        elif status == "error":
            self.errors += 1
        boxed = bool(extract_boxed(response))
        if self._cfg.graded:
            v = value if status == "ok" else 0.0
            correct = v == 1.0
            reward = self._cfg.wrong + v * (self._cfg.correct - self._cfg.wrong)
        else:
            correct = status == "ok" and value > 0.5
            reward = (self._cfg.correct if correct else self._cfg.wrong)
        reward += self._cfg.format_bonus if boxed else 0.0
        return RewardResult(reward=reward, correct=correct, error=status != "ok", boxed=boxed)

    def _resolve(self, fn: str | RewardFn) -> tuple[RewardFn, tuple[str, ...] | None]:
        try:
            return self._resolved[fn]
        except KeyError:
            resolved = resolve_reward_fn(fn)
            self._resolved[fn] = resolved, keywords(resolved)
            return self._resolved[fn]
        except TypeError:  # an unhashable callable: resolved every call
            resolved = resolve_reward_fn(fn)
            return resolved, keywords(resolved)

    @staticmethod
    def _arguments(names: tuple[str, ...] | None, response: str, gold: str,
                   prompt: list[dict[str, Any]] | None,
                   item: dict[str, Any] | None) -> tuple[tuple, dict[str, Any]]:
        """What crosses to the process: ``(response, gold)`` for the answer form (``names`` is
        ``None``); for the keyword form, only the arguments named."""
        if names is None:
            return (response, gold), {}
        value = {"response": lambda: response, "answer": lambda: gold, "item": lambda: item or {},
                 "messages": lambda: [*(prompt or ()), {"role": "assistant", "content": response}]}
        return (), {name: value[name]() for name in names}

    def stats(self) -> dict[str, float]:
        """Counters since start: ``reward/calls``, ``reward/errors``, ``reward/timeouts``,
        ``reward/restarts`` (processes replaced after dying)."""
        return {"reward/calls": self.calls, "reward/errors": self.errors,
                "reward/timeouts": self.timeouts, "reward/restarts": self.restarts}

    def _report_once(self, kind: str, message: str) -> None:
        """Print the first failure of ``kind``; later ones are counted in the stats only."""
        if kind not in self._reported:
            self._reported.add(kind)
            print(f"[reward] {message}; later ones are counted in reward/errors or "
                  f"reward/timeouts only", flush=True)

    def _count_death(self, fn: RewardFn, exitcode: int | None) -> None:
        """Count a process that died in ``fn`` (already replaced); raise once deaths in a row
        reach ``max_consecutive_deaths``."""
        self.restarts += 1
        self._deaths_in_a_row += 1
        how, limit = describe_exit(exitcode), self._cfg.max_consecutive_deaths
        print(f"[reward] a reward process died in {fn_name(fn)} ({how}); replaced "
              f"({self.restarts} so far, {self._deaths_in_a_row} in a row)", flush=True)
        if self._deaths_in_a_row >= limit:
            raise RewardProcessError(
                f"reward function {fn_name(fn)} killed its process {self._deaths_in_a_row} "
                f"times in a row (reward.max_consecutive_deaths = {limit}; last: {how}): every "
                f"reward would score as wrong. Fix the function (a crash, sys.exit() or "
                f"os._exit() in it, or a process killed for memory) or raise the bound")

    def _replace(self, proc: _Proc) -> _Proc:
        proc.kill()
        fresh = _Proc(self._ctx, self._module)
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
