"""Run a command and report the peak resident memory of its whole process tree.

    python tools/peak_rss.py -- python -m launcher.local configs/quickstart_cpu.yaml

Samples ``/proc/<pid>/status`` (VmRSS) of every descendant every ``--interval-s`` seconds and
prints the peak of the sum (shared pages are counted once per process, so this overstates a
little) and the peak per process name. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time


def _tree(root: int) -> list[int]:
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children[ppid].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _rss_kib(pid: int) -> tuple[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = " ".join(a.decode() for a in f.read().split(b"\0")[:4] if a)[-60:]
        return name, int(fields.get("VmRSS", "0 kB").split()[0])
    except (OSError, ValueError):
        return "", 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(cmd)
    peak_total, peak_by_name = 0, collections.Counter()
    while proc.poll() is None:
        sample = [_rss_kib(pid) for pid in _tree(proc.pid)]
        peak_total = max(peak_total, sum(kib for _, kib in sample))
        for name, kib in sample:
            peak_by_name[name] = max(peak_by_name[name], kib)
        time.sleep(args.interval_s)
    print(f"peak RSS of the whole job: {peak_total / 2**20:.2f} GiB", file=sys.stderr)
    for name, kib in peak_by_name.most_common(8):
        print(f"  {kib / 2**20:6.2f} GiB  {name}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
