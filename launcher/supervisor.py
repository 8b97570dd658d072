"""Child-process supervision: start, log, watch, and stop every process of a job.

``Supervisor`` starts each child in its own process group (dying with the launcher), logs it to
``RUN_DIR/logs/<name>.log`` keeping its last lines, and watches it: a child that dies is started
again under its ``Restart`` policy; any other death, or one past its restarts, stops the job
(``JobFailed``). A child with a ``HealthCheck`` is probed from a thread: after each (re)start
``/health`` every 0.5 s until it answers (at most ``startup_timeout_s``), then ``/health_generate``
every ``interval_s``; failing once up, or not up in time, it is killed and counts as dead. Only
``Supervised`` is asked of a child, so it may run elsewhere: ``Child`` here, ``launcher.ray.RayChild``
in a Ray actor, ``launcher.ray.RankGroup`` the trainer's ranks as one. Processes and logs as a user
sees them: docs/running.md, "Processes and their logs"; restarts and health checks: docs/faults.md.
"""

from __future__ import annotations

import codecs
import collections
import collections.abc
import concurrent.futures
import ctypes
import functools
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _before_exec(cpus: tuple[int, ...]) -> None:  # runs in the child between fork and exec
    _die_with_parent()
    if cpus:  # the process's threads, started after exec, inherit it
        os.sched_setaffinity(0, cpus)


@dataclass(frozen=True)
class Restart:
    """How a child that dies is started again.

    ``max_restarts``: restarts allowed (0: none, the job stops at the first death).
    ``before(why)``: called with the cause of death before each restart is scheduled; returns a
    note for the launcher's line (e.g. the groups handed back); an exception stops the job.
    ``backoff_s``: wait before the first restart, doubled for each further one, up to 30 s.
    ``argv()``: the command line of each restart, asked when the back-off is over (an inference
    server starts from the newest weights then); ``None``: the command it started with.
    """

    max_restarts: int
    before: Callable[[str], str] | None = None
    backoff_s: float = 1.0
    argv: Callable[[], list[str]] | None = None


@dataclass(frozen=True)
class HealthCheck:
    """How a running child is checked (module docstring).

    ``probe(path, timeout_s)``: ``None`` when the child answered ``GET path`` with 200 within
    ``timeout_s`` seconds, else why not (e.g. ``"no answer within 10 s"``); called in a thread.
    ``interval_s``: seconds between two checks once it is up, and each check's timeout.
    ``startup_timeout_s``: seconds a (re)started child may take to answer ``/health``.
    """

    probe: Callable[[str, float], str | None]
    interval_s: float
    startup_timeout_s: float


@runtime_checkable
class Supervised(Protocol):
    """What ``Supervisor`` reads and sets of a child (``Child`` is the reference).

    Set at start: ``name``, ``log_path``, ``expect_exit``, ``restart``, ``health``, ``echo``
    (the supervisor turns it off while stopping). Restart bookkeeping, kept by the supervisor:
    ``restarts``, ``restart_at``, ``why``. Health-check state, kept by the supervisor and reset by
    each (re)start: ``up``, ``check``, ``check_at``, ``spawned_at`` (monotonic seconds), ``hung``
    (why the check killed it). ``tail``: its last lines.
    """

    name: str
    log_path: pathlib.Path
    expect_exit: bool
    restart: Restart | None
    restarts: int
    restart_at: float | None
    why: str
    health: HealthCheck | None
    hung: str | None
    up: bool
    check: concurrent.futures.Future | None
    check_at: float
    spawned_at: float
    echo: bool

    @property
    def tail(self) -> collections.abc.Sequence[str]: ...

    def poll(self) -> int | None:
        """Its exit status (negative: killed by that signal), ``None`` while it runs."""

    def respawn(self, log_header: str) -> None:
        """Start the dead process again; its log goes on after ``log_header``."""

    def kill(self) -> None:
        """SIGKILL its process group and wait for the process (a failed health check)."""

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds; nothing of it runs afterwards."""


class Child:
    """One supervised process. ``expect_exit``: its exit (status 0) is part of a normal run;
    ``restart``: how it is started again when it dies (``None``: never); ``health``: how it is
    checked while it runs (``None``: not at all); ``cpus``: the CPUs it (and each restart) is
    pinned to, ``sched_setaffinity`` before exec (``()``: not pinned)."""

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path, env: dict,
                 echo: bool = False, expect_exit: bool = False, tail_lines: int = 40,
                 log_header: str | None = None, stop_leader_first: bool = False,
                 restart: Restart | None = None, health: HealthCheck | None = None,
                 cpus: tuple[int, ...] = ()):
        self.name = name
        self.argv = argv
        self.env = env
        self.cpus = tuple(cpus)
        self.log_path = log_dir / f"{name}.log"
        self.expect_exit = expect_exit
        self.stop_leader_first = stop_leader_first
        self.restart = restart
        self.restarts = 0  # done so far
        self.restart_at: float | None = None  # monotonic time of a scheduled restart
        self.why = ""  # how it died last
        self.health = health
        self.hung: str | None = None  # why the health check killed it
        self.up = False  # answered /health since its (re)start
        self.check: concurrent.futures.Future | None = None  # a probe in flight
        self.check_at = 0.0  # monotonic time of the next probe
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.echo = echo
        self._spawn("w" if log_header is None else "a", log_header)

    def _spawn(self, log_mode: str, log_header: str | None) -> None:
        self._log = open(self.log_path, log_mode, buffering=1)
        if log_header is not None:
            self._log.write(log_header + "\n")
        self._log.write("$ " + " ".join(self.argv) + "\n")
        self.hung, self.up, self.check = None, False, None
        self.spawned_at = self.check_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True, preexec_fn=functools.partial(_before_exec, self.cpus), bufsize=0,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def respawn(self, log_header: str, argv: list[str] | None = None) -> None:
        """Start the (dead) process again with ``argv`` (``None``: the same command); its log goes
        on after ``log_header``."""
        self.argv = self.argv if argv is None else argv
        _signal_group(self.proc.pid, signal.SIGKILL)  # what it started (a reward pool) goes too
        self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()
        self.tail.clear()
        self.restart_at = None
        self._spawn("a", log_header)

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        fd, pending, final = self.proc.stdout.fileno(), "", False
        while not final:
            chunk = os.read(fd, 1 << 16)
            final = not chunk
            text = decoder.decode(chunk, final=final)
            if self.echo and text:
                sys.stdout.write(text)
                sys.stdout.flush()
            *lines, pending = (pending + text).split("\n")
            if final and pending and "\r" not in pending:  # a bar a stopped child never ended is dropped
                lines.append(pending)
            for line in lines:
                shown = line.rpartition("\r")[2]  # what a terminal shows of a line redrawn with \r
                if shown.strip() or "\r" not in line:
                    self._log.write(shown + "\n")
                    self.tail.append(shown)
        self._log.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the process group and wait for the process."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the child's process group (``stop_leader_first``: the child alone, which stops
        its own children, as torchrun does its ranks), then SIGKILL the group after ``grace_s``
        seconds or once the child has exited."""
        if self.proc.poll() is None:
            if self.stop_leader_first:
                self.proc.send_signal(signal.SIGTERM)
            else:
                _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (e.g. torchrun's ranks): always sweep it.
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class JobFailed(RuntimeError):
    """A child exited unexpectedly; the message names it and holds its last lines."""


class Supervisor:
    """Owns every child of a job; ``stop_all`` leaves nothing running."""

    def __init__(self, log_dir: pathlib.Path, env: dict | None = None, log_header: str | None = None):
        """``log_header``: append to existing logs, each after this line (a resumed job);
        ``None``: start every log afresh."""
        self._probes = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="health")
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_header = log_header
        self.children: list[Supervised] = []

    def start(self, name: str, argv: list[str], env: dict | None = None, echo: bool = False,
              expect_exit: bool = False, stop_leader_first: bool = False,
              restart: Restart | None = None, health: HealthCheck | None = None,
              cpus: tuple[int, ...] = ()) -> Supervised:
        child = Child(name, argv, self.log_dir, {**self.env, **(env or {})}, echo, expect_exit,
                      log_header=self.log_header, stop_leader_first=stop_leader_first,
                      restart=restart, health=health, cpus=cpus)
        self.children.append(child)
        return child

    def check(self) -> None:
        """Raise ``JobFailed`` if any child exited non-zero, or exited when it should not have,
        unless its ``Restart`` policy allows one more restart: then schedule it (and start the
        ones whose back-off is over)."""
        for child in self.children:
            if child.restart_at is not None:
                if time.monotonic() >= child.restart_at:
                    self._restart(child)
                continue
            if child.health is not None and child.poll() is None:
                self._check_health(child)
            if not self._failed(child):
                continue
            time.sleep(0.2)  # let the reader thread drain the child's last output
            policy = child.restart
            if policy is not None and child.restarts < policy.max_restarts:
                self._schedule_restart(child)
                continue
            raise self._failure(child)

    def _check_health(self, child: Supervised) -> None:
        """Start a probe when one is due; act on the one that finished (module docstring)."""
        h, now = child.health, time.monotonic()
        if child.check is None:
            if now >= child.check_at:
                path, timeout_s = ("/health_generate", h.interval_s) if child.up else ("/health", 2.0)
                child.check = self._probes.submit(h.probe, path, timeout_s)
            return
        if not child.check.done():
            return
        try:
            why = child.check.result()
        except Exception as exc:  # a probe that broke tells nothing about the child: ask again
            why = None if child.up else f"{type(exc).__name__}: {exc}"
            print(f"[launcher] the health probe of {child.name} failed: {exc!r}", file=sys.stderr, flush=True)
        child.check = None
        if why is None:
            child.up = True
        elif child.up:
            child.hung = f"did not answer /health_generate: {why}"
        elif now - child.spawned_at > h.startup_timeout_s:
            child.hung = f"did not answer /health within {h.startup_timeout_s:g} s of its start: {why}"
        child.check_at = now + (h.interval_s if child.up else 0.5)
        if child.hung is not None:
            print(f"[launcher] {child.name} {child.hung}; killing it", file=sys.stderr, flush=True)
            child.kill()

    @staticmethod
    def _failed(child: Supervised) -> bool:
        rc = child.poll()
        return rc is not None and not (rc == 0 and child.expect_exit)

    @staticmethod
    def _why(child: Supervised) -> str:
        rc = child.poll()
        if child.hung is not None:
            return f"{child.hung} (killed)"
        if rc < 0:
            return f"was killed by {signal.Signals(-rc).name}"
        return f"exited with status {rc}" if rc else "exited unexpectedly (status 0)"

    @staticmethod
    def _tail(child: Supervised) -> str:
        tag = f"[{child.name}]"  # lines the child tagged itself keep their one tag
        return "\n".join(f"  {line}" if line.startswith(tag) else f"  {tag} {line}" for line in child.tail)

    def _failure(self, child: Supervised, extra: str = "") -> JobFailed:
        after = f" after {child.restarts} restart(s)" if child.restarts else ""
        return JobFailed(f"{child.name} {self._why(child)}{after}{extra}; its last lines "
                         f"(full log: {child.log_path}):\n{self._tail(child)}")

    def _schedule_restart(self, child: Supervised) -> None:
        policy, why = child.restart, self._why(child)
        try:
            note = policy.before(why) if policy.before is not None else ""
        except Exception as exc:  # e.g. the queue is gone too: then its death is the cause
            time.sleep(1.0)
            for other in self.children:
                if other.restart is None and self._failed(other):
                    raise self._failure(other) from exc
            raise self._failure(child, f", and it cannot be restarted: {exc}") from exc
        delay_s = min(policy.backoff_s * 2 ** child.restarts, 30.0)
        child.restarts += 1
        child.restart_at = time.monotonic() + delay_s
        child.why = why
        last = "\n".join(self._tail(child).splitlines()[-3:])
        print(f"[launcher] {child.name} {why}; restart {child.restarts} of {policy.max_restarts} "
              f"in {delay_s:g} s{'; ' + note if note else ''}; its last lines (full log: "
              f"{child.log_path}):\n{last}", file=sys.stderr, flush=True)

    def _restart(self, child: Supervised) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        policy = child.restart
        try:
            argv = policy.argv() if policy.argv is not None else None
        except Exception as exc:  # e.g. its weights could not be linked: the death stops the job
            raise self._failure(child, f", and it cannot be restarted: {exc}") from exc
        child.respawn(f"===== restart {child.restarts} of {policy.max_restarts}: "
                      f"{child.name} {child.why}, {stamp} =====", argv)

    def wait_for(self, child: Supervised, poll_s: float = 0.5) -> int:
        """Block until ``child`` exits, checking every other child meanwhile; return its status."""
        while (rc := child.poll()) is None:
            self.check()
            time.sleep(poll_s)
        self.check()
        return rc

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop children in reverse start order (consumers before producers before servers)."""
        self._probes.shutdown(wait=False, cancel_futures=True)
        for child in self.children:
            child.echo = False  # what a child prints while being stopped would bury the cause
        for child in reversed(self.children):
            child.stop(grace_s)
