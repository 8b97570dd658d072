"""``launcher.ray`` jobs ended by a fault or a signal, on a local Ray instance of their own.

A generation worker whose actor is killed is started again in a new actor (``release_worker``
first, as ``launcher.local`` does); then the replay queue is SIGKILLed, which must stop the job
with exit 1, naming the queue, and leave no process behind: every process the launcher started
(the Ray instance's included) is gone when it exits. SIGTERM to the launcher must do the same with
exit 130, its trainer's two ranks in two actors. One inference server each: the server count
changes nothing here (two servers' actors: ``test_launcher_ray.py``'s SGLang job).
"""

import os
import signal
import subprocess

import pytest

pytest.importorskip("ray", reason="launcher.ray needs Ray: pip install -e '.[dev]'")

from tests.support import REPO  # noqa: E402
from tests.support.jobs import job_argv, stop_and_read  # noqa: E402
from tests.support.procs import descendants, pids_running, processes, still_running, wait_until  # noqa: E402

ONE_SERVER = ("rollout.num_workers=1", "inference.num_servers=1")


def test_a_lost_worker_actor_is_replaced_and_a_dead_queue_stops_the_job_leaving_nothing(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "faults"
    config = run_dir / "config.yaml"
    out = (tmp_path / "launcher.out").open("w+")
    proc = subprocess.Popen(job_argv(tiny_model_dir, tmp_path, "faults", "deterministic", 1,
                                     extra=(*ONE_SERVER, "trainer.nproc=1"), launcher="ray"),
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        [worker] = wait_until("a worker", lambda: pids_running("areal_async.rollout.worker", config), proc)
        actor = processes()[worker][0]  # the Ray worker process that hosts worker0's actor
        os.kill(actor, signal.SIGKILL)
        [again] = wait_until("a restarted worker", lambda: [p for p in pids_running("areal_async.rollout.worker", config)
                                                            if p != worker], proc)
        assert processes()[again][0] != actor, "the restarted worker runs in a new actor"
        started = descendants(proc.pid)
        [queue] = pids_running("areal_async.queue.server", config)
        os.kill(queue, signal.SIGKILL)
        rc = proc.wait(timeout=120)
    finally:
        output = stop_and_read(proc, out)
    assert rc == 1, output[-4000:]
    assert "worker0 lost its Ray actor" in output and "restart 1 of 3" in output, output[-4000:]
    assert "job failed: queue was killed by SIGKILL" in output, output[-4000:]
    assert "===== restart 1 of 3: worker0 lost its Ray actor" in (run_dir / "logs/worker0.log").read_text()
    alive = still_running(started)
    assert len(started) >= 8 and not alive, f"left running: {alive} of {len(started)} processes the job started"


def test_sigterm_stops_every_process_and_actor_and_exits_130(tiny_model_dir, tmp_path):
    out = (tmp_path / "launcher.out").open("w+")
    proc = subprocess.Popen(job_argv(tiny_model_dir, tmp_path, "stopped", "deterministic", 1,
                                     extra=ONE_SERVER, launcher="ray"),
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until("the worker's start", lambda: "worker(s) started" in (tmp_path / "launcher.out").read_text(), proc)
        started = descendants(proc.pid)
        assert len(pids_running("areal_async.trainer.main", tmp_path / "stopped/config.yaml")) == 2
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.seek(0)
        output = out.read()
    assert rc == 130 and "interrupted; stopping every process" in output, output[-4000:]
    alive = still_running(started)
    assert len(started) >= 8 and not alive, f"left running: {alive} of {len(started)} processes the job started"
