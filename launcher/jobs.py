"""Several whole jobs on one machine: ``python -m launcher.local`` processes, side by side or in turn.

``run_jobs`` keeps at most ``parallel`` running, output appended to a file each; Ctrl-C, SIGTERM or
``deadline_s`` sends each SIGINT (exit 130), then SIGKILL after ``grace_s``. Each is detached from
the terminal (a Ctrl-C reaches it once, from here) and dies with the caller (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable

from launcher.supervisor import _die_with_parent


def local_argv(config: str, overrides: list[str], flags: list[str] = ()) -> list[str]:
    """The command line of one job: ``python -m launcher.local CONFIG OVERRIDES FLAGS``."""
    return [sys.executable, "-m", "launcher.local", config, *overrides, *flags]


@dataclasses.dataclass
class Job:
    """One launcher process: ``argv``, console output appended to ``out`` (each start after a
    ``===== <time> $ <argv> =====`` line)."""

    name: str
    argv: list[str]
    out: pathlib.Path
    proc: subprocess.Popen | None = None
    started_s: float = 0.0  # time.monotonic() at start
    returncode: int | None = None

    def start(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("a") as f:
            f.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S %Z')} $ {' '.join(self.argv)} =====\n")
            f.flush()
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=os.environ.copy(), start_new_session=True,
                                         preexec_fn=_die_with_parent)
        self.started_s = time.monotonic()

    def poll(self) -> int | None:
        if self.returncode is None and self.proc is not None:
            self.returncode = self.proc.poll()
        return self.returncode

    def exit_text(self) -> str:
        """``"exit 2"``, or ``"killed by SIGKILL"`` for a process a signal ended."""
        rc = self.poll()
        if rc is not None and rc < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-rc).name}"
        return f"exit {rc}"

    def interrupt(self) -> None:
        """SIGINT, as Ctrl-C: the launcher stops its processes and exits 130."""
        if self.proc is not None and self.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for it to exit, then SIGKILL it; its exit status."""
        try:
            self.proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.poll()

    def last_lines(self, n: int = 12) -> list[str]:
        """The last ``n`` non-empty lines of its output (this run's, after its header line)."""
        try:
            text = self.out.read_text(errors="replace")
        except OSError:
            return []
        lines = [ln for ln in text.rpartition("\n===== ")[2].splitlines()[1:] if ln.strip()]
        return lines[-n:]


def run_jobs(jobs: list[Job], parallel: int, on_start: Callable[[Job], None] = lambda job: None,
             on_end: Callable[[Job], None] = lambda job: None, on_poll: Callable[[list[Job]], None] = lambda r: None,
             poll_s: float = 1.0, stagger_s: float = 0.0, deadline_s: float = 0.0, grace_s: float = 120.0) -> bool:
    """Run ``jobs`` in order, at most ``parallel`` at once; block until all have ended.

    ``on_start``/``on_end`` are called as each starts and ends (``job.returncode`` set),
    ``on_poll`` every ``poll_s`` with the running ones. ``stagger_s``: the least time between two
    starts. Returns ``False`` if ``deadline_s`` (> 0) ran out (the running jobs were stopped, the
    others never started), else ``True``. ``KeyboardInterrupt`` stops the running jobs and is
    raised again.

    Raises:
        ValueError: ``parallel`` < 1.
    """
    if parallel < 1:
        raise ValueError(f"parallel={parallel}: at least one job must run at a time; give 1 or more")
    pending, running = list(jobs), []
    t0, last_start = time.monotonic(), -float("inf")
    try:
        while pending or running:
            for job in [j for j in running if j.poll() is not None]:
                running.remove(job)
                on_end(job)
            if deadline_s and time.monotonic() - t0 > deadline_s:
                stop_jobs(running, grace_s)
                for job in running:
                    on_end(job)
                return False
            while pending and len(running) < parallel and time.monotonic() - last_start >= stagger_s:
                job = pending.pop(0)
                job.start()
                last_start = time.monotonic()
                running.append(job)
                on_start(job)
            if pending or running:
                on_poll(running)
                time.sleep(poll_s)
    except KeyboardInterrupt:
        stop_jobs(running, grace_s)
        raise
    return True


def stop_jobs(jobs: list[Job], grace_s: float) -> None:
    """Interrupt every running job at once, then wait for them (``grace_s`` in all), killing late ones."""
    started = [job for job in jobs if job.proc is not None]
    for job in started:
        job.interrupt()
    deadline = time.monotonic() + grace_s
    for job in started:
        job.wait(deadline - time.monotonic())
