"""This machine's processes as ``/proc`` shows them, for the tests that check what a job leaves
running: every live process with its parent and start time, a process's descendants, the
processes with given arguments, and polling a condition while a job runs."""

from __future__ import annotations

import pathlib
import subprocess
import time


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live (not zombie) process."""
    found = {}
    for d in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:  # not a process, or it just ended
            continue
        fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
        if fields[0] != "Z":
            found[int(d.name)] = (int(fields[1]), fields[19])
    return found


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``root``."""
    procs, out, todo = processes(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start) in procs.items():
            if ppid == parent and pid not in out:
                out[pid] = start
                todo.append(pid)
    return out


def still_running(started: dict[int, str]) -> set[int]:
    """The processes of ``started`` (``descendants``) alive now: same pid, same start time."""
    return {pid for pid, (_, start) in processes().items() if started.get(pid) == start}


def pids_running(*args: str | pathlib.Path) -> list[int]:
    """The processes whose command line holds each of ``args`` as an argument."""
    pids = []
    for d in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(str(arg).encode() in argv for arg in args):
            pids.append(int(d.name))
    return pids


def wait_until(what: str, ready, proc: subprocess.Popen, timeout_s: float = 240):
    """Poll ``ready()`` until it returns something true, which is returned; fails when ``proc``
    ends or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (found := ready()):
        assert proc.poll() is None, f"the job ended ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)
    return found
