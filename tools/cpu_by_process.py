"""Run a command and report the CPU time of its process tree by kind of process.

    python tools/cpu_by_process.py -- .venv/bin/python -m pytest -q -n 2 --dist loadfile

Samples ``/proc/<pid>/stat`` (user + system time) of every descendant every ``--interval-s``
seconds; a process seen once is followed after its parent exits. A process's kind is its
``-m`` module (``areal_async.embedded.server``), else its script's or executable's name. Prints,
per kind, the CPU-seconds, the processes and the mean per process. Simplifications: a process
that lives less than one interval may be missed, and the CPU a process spends after the last
sample before it exits is not counted (both undercount). Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, str] | None:
    """``(parent pid, CPU ticks, start time)`` of ``pid``, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[11]) + int(fields[12]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def kind_of(argv: list[str]) -> str:
    """The kind of a process from its command line: the ``-m`` module, else the first argument that
    names a script (``*.py``), else the executable's name; ``?`` for an empty one."""
    if not argv:
        return "?"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    if scripts:
        return os.path.basename(scripts[0])
    if "-c" in argv[:-1]:
        return f"{os.path.basename(argv[0])} -c"
    return os.path.basename(argv[0])


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def sample(root: int, seen: dict[tuple[int, str], list]) -> None:
    """Update ``seen[(pid, start)] = [ticks, kind]`` for ``root``'s descendants and every process
    already in ``seen``."""
    parents, stats = collections.defaultdict(list), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            stats[int(entry)] = st
            parents[st[0]].append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(parents.get(pid, []))
    known = {pid for pid, _ in seen}
    for pid in tree | known:
        if pid not in stats:
            continue
        _, ticks, start = stats[pid]
        entry = seen.get((pid, start))
        if entry is not None:
            entry[0] = ticks
        elif pid in tree:
            seen[(pid, start)] = [ticks, kind_of(_argv(pid))]


def table(seen: dict[tuple[int, str], list]) -> list[tuple[str, float, int]]:
    """``(kind, CPU-seconds, processes)`` rows, most CPU first."""
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0])
    for ticks, kind in seen.values():
        by_kind[kind][0] += ticks
        by_kind[kind][1] += 1
    return sorted(((k, t / TICKS_PER_S, n) for k, (t, n) in by_kind.items()), key=lambda r: -r[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=20, help="kinds to print")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give the command to run after --")
    seen: dict[tuple[int, str], list] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        sample(proc.pid, seen)
        time.sleep(args.interval_s)
    rows = table(seen)
    wall = time.monotonic() - t0
    print(f"{sum(r[1] for r in rows):.1f} CPU-s in {len(seen)} processes over {wall:.1f} s", file=sys.stderr)
    print(f"{'CPU-s':>8} {'procs':>6} {'s/proc':>7}  kind", file=sys.stderr)
    for kind, cpu_s, n in rows[:args.top]:
        name = re.sub(r"\s+", " ", kind)[:70]
        print(f"{cpu_s:8.1f} {n:6d} {cpu_s / n:7.2f}  {name}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
