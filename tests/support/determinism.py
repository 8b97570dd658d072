"""What the determinism tests (``tests/test_determinism*.py``) share: the undisturbed runs every
fault run is compared with, run once per pytest run, and the checks of a fault run.

- ``SharedJobRuns``: ``JobRuns`` whose fingerprints the test processes of one pytest-xdist run
  share: each job runs once, in the process that asks first (a file lock), kept as JSON.
- ``calm``: the undisturbed deterministic run of jitter seed 1, checked.
- ``trained_ids``, ``strip_faults``, ``check_killed_run``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

from filelock import FileLock, Timeout

from tests.support.chaos import FAULT_KEYS
from tests.support.jobs import STEPS, JobRuns, fingerprint


class SharedJobRuns(JobRuns):
    """``JobRuns`` under ``root``, a directory every test process of this pytest run sees: a job
    another process ran (or runs: its lock is held) is read from ``<mode>-<seed>.json`` there. The
    model's files are in the name: runs of different models are never mixed."""

    def __init__(self, model_dir: pathlib.Path, root: pathlib.Path, extra: tuple[str, ...] = ()):
        digest = hashlib.sha256()
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            digest.update((model_dir / name).read_bytes())
        root = root / f"shared-runs-{digest.hexdigest()[:12]}"
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(model_dir, root, extra=extra)
        self._held: dict[tuple[str, int], FileLock] = {}

    def _paths(self, key: tuple[str, int]) -> tuple[pathlib.Path, FileLock]:
        mode, seed = key
        return self._root / f"{mode}-{seed}.json", FileLock(self._root / f"{mode}-{seed}.lock")

    def start(self, *keys: tuple[str, int]) -> None:
        for key in keys:
            if key in self or key in self._held:
                continue
            done, lock = self._paths(key)
            try:
                lock.acquire(timeout=0)
            except Timeout:  # another process runs it
                continue
            if done.exists():
                lock.release()
                continue
            self._held[key] = lock
            super().start(key)

    def __missing__(self, key: tuple[str, int]) -> dict:
        done, lock = self._paths(key)
        if key not in self._held:
            with lock.acquire(timeout=900):  # until the process running it wrote it
                if done.exists():
                    self[key] = json.loads(done.read_text())
                    return self[key]
                self._held[key] = lock  # it failed there: run here
                lock.acquire()
        try:
            super().start(key)
            found = super().__missing__(key)
            tmp = done.with_suffix(f".{os.getpid()}")
            tmp.write_text(json.dumps(found))
            tmp.replace(done)
            return found
        finally:
            self._held.pop(key).release()

    def close(self) -> None:
        super().close()
        for lock in self._held.values():
            lock.release()
        self._held.clear()


def shared_root(tmp_path_factory) -> pathlib.Path:
    """A directory every test process of this pytest run sees (pytest-xdist: its workers' common
    base), none other's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def calm(runs: JobRuns) -> dict:
    """The undisturbed deterministic run of jitter seed 1, which every other run must equal; its
    rewards are mixed (a gradient to train on) and its staleness within η = 1."""
    a = runs["deterministic", 1]
    assert len(a["trajectories"]) == STEPS and [r["step"] for r in a["metrics"]] == list(range(STEPS))
    assert any(0 < r["rollout/correct"] < 1 for r in a["metrics"]), "rewards were never mixed"
    assert all(r["staleness/max"] <= 1 for r in a["metrics"])
    return a


def strip_faults(rows: list[dict]) -> list[dict]:
    """Metric rows without the counters of the faults (``FAULT_KEYS``)."""
    return [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in rows]


def trained_ids(run_dir: pathlib.Path) -> list[int]:
    """The group ids the trainer trained on, in order (``trajectories.jsonl``)."""
    return [g["group_id"] for line in (run_dir / "trajectories.jsonl").read_text().splitlines()
            for g in json.loads(line)["groups"]]


def check_killed_run(killed_run, runs: JobRuns) -> None:
    """A job whose server 1 and then its only worker were SIGKILLed (``killed_run``: exit status,
    output, run directory) restarted both, trained every group once and equals ``calm``."""
    rc, output, run_dir = killed_run
    assert rc == 0, output[-4000:]
    assert "worker0 was killed by SIGKILL; restart 1 of 3" in output
    assert "server1 was killed by SIGKILL; restart 1 of 3" in output
    assert "===== restart 1 of 3: server1 was killed by SIGKILL" in (run_dir / "logs/server1.log").read_text()
    assert "===== restart 1 of 3: worker0 was killed by SIGKILL" in (run_dir / "logs/worker0.log").read_text()

    acct = json.loads((run_dir / "queue_accounting.json").read_text())
    assert acct["released"] >= 1 and acct["worker_restarts"] == 1, "the worker held no group when killed"
    assert (acct["server_failures"], acct["server_restarts"]) == (1, 1)
    assert acct["leased"] == acct["consumed"] + acct["ready"] + acct["running"] + acct["rejected"] + acct["requeued"]
    consumed = sorted(int(g) for g, s in acct["groups"].items() if s == "consumed")
    assert consumed == list(range(STEPS * 2)) and acct["requeued"] == 0
    assert trained_ids(run_dir) == list(range(STEPS * 2)), "a group was lost or trained twice"

    killed, undisturbed = fingerprint(run_dir), calm(runs)
    assert killed["metrics"][-1]["rollout/worker_restarts"] == 1
    assert killed["metrics"][-1]["rollout/server_failures"] == killed["metrics"][-1]["rollout/server_restarts"] == 1
    assert killed["metrics"][0]["rollout/server_failures"] == 0
    assert strip_faults(killed["metrics"]) == strip_faults(undisturbed["metrics"])
    assert killed["trajectories"] == undisturbed["trajectories"]
    assert killed["weights"] == undisturbed["weights"]
