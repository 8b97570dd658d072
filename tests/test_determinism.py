"""The determinism proof, end to end through the launcher (docs/design.md, "Determinism").

Two runs of ``mode: deterministic`` (η = 1, 2 embedded servers, 2 workers, a 2-rank trainer, the
tiny fixture model) with random timing jitter in workers, servers, queue and trainer, seeded
differently (``debug.jitter_seed`` 1 and 2), must give identical per-step metrics (wall-clock
and queue-snapshot numbers excluded, ``TIMING_KEYS`` in ``tests/support/jobs.py``), identical
trajectories (the trainer's ``trajectories.jsonl``) and identical final weights (SHA-256 over the
state dict) (``slow``: by default the seed-1 run, run once per pytest run and shared by the test
processes (``det_runs``), is compared with the fault runs of jitter seed 3 here, in
``test_determinism_killed.py`` and in ``test_determinism_ray.py``). The same pair of runs in
``mode: throughput`` must differ, which shows the comparison can fail (``slow``; by default
``tests/test_episode_determinism.py`` shows it on episodes).

A job with one inference server (disk weight sync, one worker) whose server is SIGKILLed while it
generates must finish: the launcher restarts the server from the newest weights, the calls wait
for it, and the run equals the undisturbed one.
"""

import functools
import json
import os
import re

import pytest

from tests.support.chaos import CHAOS_TOKEN, generating, pids, start_chaos_job, wait
from tests.support.determinism import calm, strip_faults, trained_ids
from tests.support.jobs import STEPS, fingerprint, stop_and_read


# the fault runs (jitter seed 3) equal the seed-1 run with faults on top
@pytest.mark.slow
def test_deterministic_runs_are_bitwise_identical_under_jitter(det_runs):
    a, b = calm(det_runs), det_runs["deterministic", 2]
    print(f"\ndeterministic weights sha256: {a['weights']} / {b['weights']}")
    for step, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"])):
        assert ra == rb, f"metrics of step {step} differ: " + str(
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)})
    for step, (ta, tb) in enumerate(zip(a["trajectories"], b["trajectories"])):
        assert ta == tb, f"trajectories of step {step} differ"
    assert a["weights"] == b["weights"]


@pytest.mark.slow  # the same comparison failing in throughput mode runs by default on episodes (test_episode_determinism)
def test_throughput_runs_differ_under_jitter(det_runs):
    a, b = det_runs["throughput", 1], det_runs["throughput", 2]
    differ = {key: a[key] != b[key] for key in ("metrics", "trajectories", "weights")}
    print(f"\nthroughput weights sha256: {a['weights']} / {b['weights']}; differ: {differ}")
    assert differ["trajectories"] and differ["weights"]


@pytest.fixture(scope="module")
def lone_server_run(tiny_model_dir, tmp_path_factory, det_runs):
    """A job with one inference server (disk sync, one worker) whose server is SIGKILLed while it
    runs a generation, after step 0 was logged; returns (exit status, the launcher's output, run
    directory). The undisturbed run it is compared with runs alongside."""
    import signal

    from areal_async.config import load_config

    det_runs.start(("deterministic", 1))
    root, run_dir, out, proc = start_chaos_job(tiny_model_dir, tmp_path_factory.mktemp("lone"), "lone-server",
                                               ("inference.num_servers=1", "rollout.num_workers=1",
                                                "trainer.weight_sync=disk"))
    token = CHAOS_TOKEN
    try:
        cfg = load_config(run_dir / "config.yaml")
        assert cfg.inference.num_servers == 1

        wait("a generation on the server", functools.partial(generating, cfg.inference.urls()[0], token), 60, proc)
        [server] = pids(str(cfg.inference.base_port), b"areal_async.embedded.server")
        os.kill(server, signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        output = stop_and_read(proc, out)
    return proc.returncode, output, run_dir


def test_a_job_whose_only_server_is_killed_finishes_and_equals_an_undisturbed_one(lone_server_run, det_runs):
    # The launcher restarts the server from the newest weights directory at its version; the
    # worker's and the trainer's calls wait for it meanwhile; the generations it ran are resubmitted
    # to it (same rid, seed, prompt + output so far), and the run ends as the undisturbed one (two
    # servers, two workers: neither count decides anything in deterministic mode).
    rc, output, run_dir = lone_server_run
    assert rc == 0, output[-4000:]
    assert "server0 was killed by SIGKILL; restart 1 of 3" in output
    started = re.findall(r"\[launcher\] server0 starts from (\S+) \(weight version (\d+)\)", output)
    assert len(started) == 1, output[-4000:]
    path, version = started[0]
    assert path == str((run_dir / "restart_weights" / "server0" / f"v{version}").resolve()) and int(version) >= 1
    assert "===== restart 1 of 3: server0 was killed by SIGKILL" in (run_dir / "logs/server0.log").read_text()
    assert "taken out of routing (/generate: " in (run_dir / "logs/worker0.log").read_text()

    acct = json.loads((run_dir / "queue_accounting.json").read_text())
    assert (acct["server_failures"], acct["server_restarts"]) == (1, 1)
    assert acct["leased"] == acct["consumed"] + acct["ready"] + acct["running"] + acct["rejected"] + acct["requeued"]
    assert sorted(int(g) for g, s in acct["groups"].items() if s == "consumed") == list(range(STEPS * 2))
    assert trained_ids(run_dir) == list(range(STEPS * 2)), "a group was lost or trained twice"

    lone, undisturbed = fingerprint(run_dir), calm(det_runs)
    assert lone["metrics"][-1]["rollout/server_failures"] == lone["metrics"][-1]["rollout/server_restarts"] == 1
    assert strip_faults(lone["metrics"]) == strip_faults(undisturbed["metrics"])
    assert lone["trajectories"] == undisturbed["trajectories"]
    assert lone["weights"] == undisturbed["weights"]
