"""Faults injected into a running determinism job: starting it in the background, finding its
processes, waiting on it, and asking its servers and queue what they do now.

- ``start_chaos_job``: a deterministic 4-step job (``tests/support/jobs.py``) started with the
  launcher's token ``CHAOS_TOKEN``, returned once its step 0 is logged.
- ``pids``: the processes of a module on a config (or a server on a port).
- ``wait``: poll a condition while the job runs.
- ``generating``: whether an inference server runs a generation now.
- ``holding``: whether a worker holds a running group while the trainer is past a step.
- ``FAULT_KEYS``: the metrics that count faults (0 in an undisturbed run).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
import urllib.request

from tests.support import REPO
from tests.support.jobs import STEPS, job_argv

CHAOS_TOKEN = "chaos-test-token"  # the job's token, given to the launcher, so a test can ask the queue

# Counters of the restart itself: 0 in an undisturbed run, what the fault changed on purpose.
FAULT_KEYS = {"queue/released", "queue/requeued", "rollout/worker_restarts", "rollout/server_failures",
              "rollout/server_restarts"}


def start_chaos_job(model_dir: pathlib.Path, root: pathlib.Path, name: str, extra: tuple[str, ...],
                    jitter_seed: int = 3, steps: int = STEPS):
    """Start a deterministic ``steps``-step job under ``root`` (``extra``: more overrides) and wait
    for its step 0; returns (root, run directory, its output file, the launcher process)."""
    out = (root / "launcher.out").open("w+")
    proc = subprocess.Popen(job_argv(model_dir, root, name, "deterministic", jitter_seed, steps, extra=extra), cwd=REPO,
                            stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "AREAL_ASYNC_TOKEN": CHAOS_TOKEN})
    metrics = root / name / "metrics.jsonl"
    try:
        wait("step 0", lambda: metrics.exists() and "train/loss" in metrics.read_text(), 150, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return root, root / name, out, proc


def generating(url: str, token: str) -> bool:
    """Whether the server at ``url`` runs a request now: a generation is in flight there."""
    ask = urllib.request.Request(f"{url}/get_server_info", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(ask, timeout=5) as resp:
        return json.load(resp)["internal_states"][0]["num_running_reqs"] > 0


def holding(queue, step: int, token: str = CHAOS_TOKEN) -> bool:
    """Whether a group is running (a worker is mid-group) and the trainer is past step ``step`` - 1,
    asked of the job's queue (``queue``: its config section)."""
    import asyncio

    from areal_async.queue.client import QueueClient

    async def ask() -> bool:
        async with await QueueClient.connect(queue.host, queue.port, timeout_s=5, token=token) as q:
            stats = await q.stats()
            return stats.running > 0 and stats.next_step >= step

    return asyncio.run(ask())


def pids(config_path: pathlib.Path | str, module: bytes = b"areal_async.rollout.worker") -> list[int]:
    """Processes whose command line runs ``module`` on ``config_path``, or (a server, which takes
    no config) with ``config_path`` as its ``--port``."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it just ended
            continue
        if module in argv and str(config_path).encode() in argv:
            found.append(int(d.name))
    return found


def wait(what: str, ready, timeout_s: float, proc: subprocess.Popen) -> None:
    """Poll ``ready()`` until true; fails when ``proc`` ends or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the job ended ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)
