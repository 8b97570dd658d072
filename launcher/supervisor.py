"""Child-process supervision: start, log, watch, and stop every process of a job.

Each child runs in its own session (process group), so stopping it also stops whatever it
started (torchrun's ranks, a server's helpers). Output goes line by line to
``RUN_DIR/logs/<name>.log`` (replaced by a new job; a resumed job appends after a separator line,
``Supervisor(log_header=...)``), into a ring buffer of the last lines (printed when the child fails)
and, for children started with ``echo=True``, to the console. The console gets the child's bytes
as they come, so a progress bar redrawn with ``\r`` (``areal_async.progress``) moves in place; the
log and the ring buffer get finished lines only, each as a terminal would leave it (the text after
its last ``\r``; a line a bar cleared is dropped). On Linux each child also gets
``PR_SET_PDEATHSIG = SIGKILL`` so that it dies with the launcher even if the launcher is killed
with SIGKILL and cannot clean up.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Child:
    """One supervised process. ``expect_exit``: its exit (status 0) is part of a normal run."""

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path, env: dict,
                 echo: bool = False, expect_exit: bool = False, tail_lines: int = 40,
                 log_header: str | None = None, stop_leader_first: bool = False):
        self.name = name
        self.argv = argv
        self.expect_exit = expect_exit
        self.stop_leader_first = stop_leader_first
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log = open(log_dir / f"{name}.log", "w" if log_header is None else "a", buffering=1)
        if log_header is not None:
            self._log.write(log_header + "\n")
        self._log.write("$ " + " ".join(argv) + "\n")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=_die_with_parent, bufsize=0,
        )
        self.echo = echo
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

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
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_header = log_header
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict | None = None, echo: bool = False,
              expect_exit: bool = False, stop_leader_first: bool = False) -> Child:
        child = Child(name, argv, self.log_dir, {**self.env, **(env or {})}, echo, expect_exit,
                      log_header=self.log_header, stop_leader_first=stop_leader_first)
        self.children.append(child)
        return child

    def check(self) -> None:
        """Raise ``JobFailed`` if any child exited non-zero, or exited when it should not have."""
        for child in self.children:
            rc = child.poll()
            if rc is None or (rc == 0 and child.expect_exit):
                continue
            time.sleep(0.2)  # let the reader thread drain the child's last output
            tag = f"[{child.name}]"  # lines the child tagged itself keep their one tag
            tail = "\n".join(f"  {line}" if line.startswith(tag) else f"  {tag} {line}" for line in child.tail)
            if rc < 0:
                why = f"was killed by {signal.Signals(-rc).name}"
            else:
                why = f"exited with status {rc}" if rc else "exited unexpectedly (status 0)"
            raise JobFailed(f"{child.name} {why}; its last lines "
                            f"(full log: {self.log_dir / (child.name + '.log')}):\n{tail}")

    def wait_for(self, child: Child, poll_s: float = 0.5) -> int:
        """Block until ``child`` exits, checking every other child meanwhile; return its status."""
        while (rc := child.poll()) is None:
            self.check()
            time.sleep(poll_s)
        self.check()
        return rc

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop children in reverse start order (consumers before producers before servers)."""
        for child in self.children:
            child.echo = False  # what a child prints while being stopped would bury the cause
        for child in reversed(self.children):
            child.stop(grace_s)
