"""The determinism proof under faults, end to end through the launcher: a deterministic job (disk
weight sync, and again distributed) whose inference server 1 is SIGKILLed while a group runs, and
then its only worker while it holds groups, must finish (the clients move the dead server's
generations to server 0, same rids and seeds; the launcher restarts the server, which rejoins at
the trainer's next update, and the worker, and the queue hands the worker's groups out again),
train every group once, count one server failure and restart, and equal the undisturbed run
(``det_runs``, ``tests/test_determinism.py``); without the queue's release it hangs at the batch
of the lost groups, and the test fails at its 150 s bound; without the failover the worker dies at
every try (the disk-sync run is ``slow``: ``test_determinism.py``'s lone-server run kills a server
under the disk sync). A ``--resume`` of the distributed run for two more steps then trains groups
0..N-1 exactly once each.
"""

import functools
import json
import os

import pytest

from tests.support.chaos import CHAOS_TOKEN, generating, holding, pids, start_chaos_job, wait
from tests.support.determinism import check_killed_run, trained_ids
from tests.support.jobs import STEPS, run_job, stop_and_read


@pytest.fixture(scope="module")
def killed_run(tiny_model_dir, tmp_path_factory):
    """One worker (the worker count decides nothing in deterministic mode), SIGKILLed while it holds
    groups, after inference server 1 was SIGKILLed while a group ran, after step 0 was logged;
    weights sent from disk; returns (exit status, the launcher's output, run directory)."""
    return _killed_run(tiny_model_dir, tmp_path_factory, "disk")


@pytest.fixture(scope="module")
def killed_run_distributed(tiny_model_dir, tmp_path_factory, det_runs):
    """``killed_run`` with the weights broadcast (``trainer.weight_sync=distributed``); the
    undisturbed run it is compared with runs alongside, unless another test process runs it."""
    det_runs.start(("deterministic", 1))
    return _killed_run(tiny_model_dir, tmp_path_factory, "distributed")


def _killed_run(tiny_model_dir, tmp_path_factory, weight_sync: str):
    import signal

    from areal_async.config import load_config

    root, run_dir, out, proc = start_chaos_job(tiny_model_dir, tmp_path_factory.mktemp(f"killed-{weight_sync}"),
                                               "killed-worker", ("rollout.num_workers=1",
                                                                 f"trainer.weight_sync={weight_sync}"))
    token = CHAOS_TOKEN
    try:
        cfg = load_config(run_dir / "config.yaml")
        queue = cfg.queue

        wait("a generation on server 1", functools.partial(generating, cfg.inference.urls()[1], token), 60, proc)
        [server] = pids(str(cfg.inference.base_port + 1), b"areal_async.embedded.server")
        os.kill(server, signal.SIGKILL)
        log = run_dir / "logs" / "worker0.log"
        wait("the worker's failover", lambda: "taken out of routing (/generate: " in log.read_text(), 60, proc)
        wait("a running group of a later step", lambda: holding(queue, 2, token), 90, proc)
        [pid] = pids(run_dir / "config.yaml")
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=150)  # without the release the batch of the lost groups never completes
    finally:
        output = stop_and_read(proc, out)
    return proc.returncode, output, run_dir


# the same faults with the distributed sync below; a server killed under the disk sync: the lone-server run
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_equals_an_undisturbed_one(killed_run, det_runs):
    # The launcher restarts the worker, the queue hands its groups out again (same ids and seeds),
    # and the run ends exactly as the undisturbed 2-worker run.
    check_killed_run(killed_run, det_runs)


def test_the_killed_run_with_the_distributed_weight_sync_equals_an_undisturbed_one(killed_run_distributed, det_runs):
    # As above with the weights broadcast: the trainer rebuilds its weight-update group without the
    # dead server, and again with it once restarted (weight_sync.py), and the run ends exactly as
    # the undisturbed one (itself run with the distributed sync, the default).
    rc, output, run_dir = killed_run_distributed
    check_killed_run(killed_run_distributed, det_runs)
    trainer_log = (run_dir / "logs/trainer.log").read_text()
    assert "rebuilding the weight-update group 'weight_update_group'" in trainer_log, trainer_log[-3000:]


def test_resume_after_the_restart_trains_every_group_once(killed_run_distributed, tiny_model_dir):
    # --resume of the distributed run above for 2 more steps: the queue restarts at version 4 with
    # the groups it had finished (8..11, saved with the checkpoint); every batch is trained once, in order.
    rc, output, run_dir = killed_run_distributed
    assert rc == 0, output[-4000:]
    run_job(tiny_model_dir, run_dir.parent, run_dir.name, "deterministic", 4, steps=STEPS + 2,
            resume=True, extra=("rollout.num_workers=1",))
    assert trained_ids(run_dir) == list(range((STEPS + 2) * 2))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 2))
    acct = json.loads((run_dir / "queue_accounting.json").read_text())  # of the groups since the resume
    assert sorted(int(g) for g, s in acct["groups"].items() if s == "consumed") == [8, 9, 10, 11]
