"""The determinism proof, end to end through the launcher (docs/design.md, "Determinism").

Two runs of ``mode: deterministic`` (η = 1, 2 embedded servers, 2 workers, a 2-rank trainer, the
tiny fixture model) with random timing jitter in workers, servers, queue and trainer, seeded
differently (``debug.jitter_seed`` 1 and 2), must give identical per-step metrics (wall-clock
and queue-snapshot numbers excluded, ``TIMING_KEYS`` in ``tests/support/jobs.py``), identical
trajectories (the trainer's ``trajectories.jsonl``) and identical final weights (SHA-256 over the
state dict) (``slow``: by default the seed-1 run is compared with the fault runs below, jitter
seed 3). The same pair of runs in ``mode: throughput`` must differ, which shows the comparison
can fail (``slow``; by default ``tests/test_episode_determinism.py`` shows it on episodes).

The same job under ``launcher.ray`` (each process in a Ray actor, one actor per trainer rank) on
two Ray nodes of this host, with a hung inference server (killed by the launcher's health check
and restarted) and a ``--resume`` after step 2, must equal the ``launcher.local`` run bit for bit.

Faults: a deterministic job (disk weight sync, and again distributed) whose inference server 1 is
SIGKILLed while a group runs, and then its only worker while it holds groups, must finish (the clients move the dead
server's generations to server 0, same rids and seeds; the launcher restarts the server, which
rejoins at the trainer's next update, and the worker, and the queue hands the worker's groups out
again), train every group once, count one server failure and restart, and equal the undisturbed
run; without the queue's release it hangs at the batch of the lost groups, and the test fails at
its 150 s bound; without the failover the worker dies at every try (the disk-sync run is ``slow``:
the lone-server run kills a server under the disk sync). A ``--resume`` of the distributed run for
two more steps then trains groups 0..N-1 exactly once each.
"""

import functools
import json
import os
import pathlib
import re
import subprocess

import pytest

from tests.support import REPO
from tests.support.chaos import CHAOS_TOKEN, FAULT_KEYS, generating, holding, pids, start_chaos_job, wait
from tests.support.jobs import STEPS, JobRuns, fingerprint, job_argv, run_job, stop_and_read

@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """``runs[mode, jitter_seed]``: the fingerprint of that undisturbed job, run on first use."""
    runs = JobRuns(tiny_model_dir, tmp_path_factory.mktemp("det-runs"))
    yield runs
    runs.close()


def _calm(runs) -> dict:
    """The undisturbed deterministic run of jitter seed 1, which every other run must equal; its
    rewards are mixed (a gradient to train on) and its staleness within η = 1."""
    a = runs["deterministic", 1]
    assert len(a["trajectories"]) == STEPS and [r["step"] for r in a["metrics"]] == list(range(STEPS))
    assert any(0 < r["rollout/correct"] < 1 for r in a["metrics"]), "rewards were never mixed"
    assert all(r["staleness/max"] <= 1 for r in a["metrics"])
    return a


# the killed and lone-server runs below (jitter seed 3) equal the seed-1 run with faults on top
@pytest.mark.slow
def test_deterministic_runs_are_bitwise_identical_under_jitter(runs):
    a, b = _calm(runs), runs["deterministic", 2]
    print(f"\ndeterministic weights sha256: {a['weights']} / {b['weights']}")
    for step, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"])):
        assert ra == rb, f"metrics of step {step} differ: " + str(
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)})
    for step, (ta, tb) in enumerate(zip(a["trajectories"], b["trajectories"])):
        assert ta == tb, f"trajectories of step {step} differ"
    assert a["weights"] == b["weights"]


@pytest.mark.slow  # the same comparison failing in throughput mode runs by default on episodes (test_episode_determinism)
def test_throughput_runs_differ_under_jitter(runs):
    a, b = runs["throughput", 1], runs["throughput", 2]
    differ = {key: a[key] != b[key] for key in ("metrics", "trajectories", "weights")}
    print(f"\nthroughput weights sha256: {a['weights']} / {b['weights']}; differ: {differ}")
    assert differ["trajectories"] and differ["weights"]


@pytest.fixture(scope="module")
def killed_run(tiny_model_dir, tmp_path_factory):
    """One worker (the worker count decides nothing in deterministic mode), SIGKILLed while it holds
    groups, after inference server 1 was SIGKILLed while a group ran, after step 0 was logged;
    weights sent from disk; returns (exit status, the launcher's output, run directory)."""
    return _killed_run(tiny_model_dir, tmp_path_factory, "disk")


@pytest.fixture(scope="module")
def killed_run_distributed(tiny_model_dir, tmp_path_factory):
    """``killed_run`` with the weights broadcast (``trainer.weight_sync=distributed``)."""
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


@pytest.fixture(scope="module")
def lone_server_run(tiny_model_dir, tmp_path_factory, runs):
    """A job with one inference server (disk sync, one worker) whose server is SIGKILLed while it
    runs a generation, after step 0 was logged; returns (exit status, the launcher's output, run
    directory). The undisturbed run it is compared with runs alongside."""
    import signal

    from areal_async.config import load_config

    runs.start(("deterministic", 1))
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


def test_a_job_whose_only_server_is_killed_finishes_and_equals_an_undisturbed_one(lone_server_run, runs):
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
    assert _trained_ids(run_dir) == list(range(STEPS * 2)), "a group was lost or trained twice"

    lone, calm = fingerprint(run_dir), _calm(runs)
    assert lone["metrics"][-1]["rollout/server_failures"] == lone["metrics"][-1]["rollout/server_restarts"] == 1
    strip = lambda rows: [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in rows]  # noqa: E731
    assert strip(lone["metrics"]) == strip(calm["metrics"])
    assert lone["trajectories"] == calm["trajectories"]
    assert lone["weights"] == calm["weights"]


def _trained_ids(run_dir: pathlib.Path) -> list[int]:
    return [g["group_id"] for line in (run_dir / "trajectories.jsonl").read_text().splitlines()
            for g in json.loads(line)["groups"]]


# the same faults with the distributed sync below; a server killed under the disk sync: the lone-server run
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_equals_an_undisturbed_one(killed_run, runs):
    # The launcher restarts the worker, the queue hands its groups out again (same ids and seeds),
    # and the run ends exactly as the undisturbed 2-worker run.
    _check_the_killed_run(killed_run, runs)


def test_the_killed_run_with_the_distributed_weight_sync_equals_an_undisturbed_one(killed_run_distributed, runs):
    # As above with the weights broadcast: the trainer rebuilds its weight-update group without the
    # dead server, and again with it once restarted (weight_sync.py), and the run ends exactly as
    # the undisturbed one (itself run with the distributed sync, the default).
    rc, output, run_dir = killed_run_distributed
    _check_the_killed_run(killed_run_distributed, runs)
    trainer_log = (run_dir / "logs/trainer.log").read_text()
    assert "rebuilding the weight-update group 'weight_update_group'" in trainer_log, trainer_log[-3000:]


def _check_the_killed_run(killed_run, runs) -> None:
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
    assert _trained_ids(run_dir) == list(range(STEPS * 2)), "a group was lost or trained twice"

    killed, calm = fingerprint(run_dir), _calm(runs)
    assert killed["metrics"][-1]["rollout/worker_restarts"] == 1
    assert killed["metrics"][-1]["rollout/server_failures"] == killed["metrics"][-1]["rollout/server_restarts"] == 1
    assert killed["metrics"][0]["rollout/server_failures"] == 0
    strip = lambda rows: [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in rows]  # noqa: E731
    assert strip(killed["metrics"]) == strip(calm["metrics"])
    assert killed["trajectories"] == calm["trajectories"]
    assert killed["weights"] == calm["weights"]


def test_resume_after_the_restart_trains_every_group_once(killed_run_distributed, tiny_model_dir):
    # --resume of the distributed run above for 2 more steps: the queue restarts at version 4 with
    # the groups it had finished (8..11, saved with the checkpoint); every batch is trained once, in order.
    rc, output, run_dir = killed_run_distributed
    assert rc == 0, output[-4000:]
    run_job(tiny_model_dir, run_dir.parent, run_dir.name, "deterministic", 4, steps=STEPS + 2,
            resume=True, extra=("rollout.num_workers=1",))
    assert _trained_ids(run_dir) == list(range((STEPS + 2) * 2))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 2))
    acct = json.loads((run_dir / "queue_accounting.json").read_text())  # of the groups since the resume
    assert sorted(int(g) for g, s in acct["groups"].items() if s == "consumed") == [8, 9, 10, 11]


@pytest.mark.timeout(600)  # run alone (-k): it runs the launcher.local job too
def test_the_ray_launcher_on_two_nodes_survives_a_hung_server_resumes_and_equals_the_local_run(
        runs, tiny_model_dir, tmp_path, monkeypatch):
    # Two Ray nodes on this host (ray.cluster_utils.Cluster: two raylets, distinct node ids), the
    # second at 127.0.0.2: the servers and the worker pinned to it, the queue and the trainer's 2
    # ranks to the head, the launcher's node. The servers listen on 127.0.0.2 (their node's
    # address, put in config.yaml), their logs and the worker's come from that node's actors; the
    # queue, which the worker calls from the other node, listens on the head's address, and so
    # does the distributed weight-update group's store, which rank 0 hosts for the servers.
    # Server 1 is SIGSTOPped while it generates: the launcher's health check (from the head,
    # against its URL) kills it through its actor and it is started again. The job stops after its
    # step-2 checkpoint, and a --resume on the same cluster runs steps 2 and 3: the run must equal
    # launcher.local's undisturbed 4-step run.
    import shutil
    import signal
    import tempfile

    from areal_async.config import load_config

    cluster_utils = pytest.importorskip("ray.cluster_utils", reason="launcher.ray needs Ray: pip install -e '.[dev]'")
    # Ray's files of this cluster (its sockets: a short path) and the record of the machine's
    # current cluster, which a plain ray.init() elsewhere on the machine would join, stay here
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=3, node_ip_address="127.0.0.2")
        head = cluster.head_node.node_ip_address
        assert head != "127.0.0.2"
        token = "two-node-test-token"
        extra = ("rollout.num_workers=1", "inference.health_check_interval_s=3",
                 "cluster.server_node=127.0.0.2", "cluster.worker_node=127.0.0.2",
                 f"cluster.queue_node={head}", f"cluster.trainer_node={head}")

        def launch(steps: int, resume: bool) -> subprocess.Popen:
            argv = job_argv(tiny_model_dir, tmp_path, "two-nodes", "deterministic", 5, steps, resume, extra=extra,
                            launcher="ray")
            return subprocess.Popen([*argv, "--address", cluster.address], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, env={**os.environ, "AREAL_ASYNC_TOKEN": token})

        run_dir, out = tmp_path / "two-nodes", (tmp_path / "launcher.out").open("w+")
        proc = launch(2, resume=False)
        try:
            config = run_dir / "config.yaml"
            healthy = lambda: "server(s) healthy" in (tmp_path / "launcher.out").read_text()  # noqa: E731
            wait("the servers' start", healthy, 240, proc)
            inf = load_config(config).inference
            assert inf.host == "127.0.0.2", "the servers' URLs do not use their node's address"
            assert load_config(config).queue.host == head, "the queue, called from the other node, is on loopback"
            assert load_config(config).trainer.weight_sync_host == head, "the weight group's store is on loopback"

            wait("a generation on server 1", functools.partial(generating, inf.urls()[1], token), 120, proc)
            [server] = pids(str(inf.base_port + 1), b"areal_async.embedded.server")
            os.kill(server, signal.SIGSTOP)
            proc.wait(timeout=240)
        finally:
            output = stop_and_read(proc, out)
        assert proc.returncode == 0, output[-4000:]
        assert f"on node(s) 127.0.0.2, {head}" in output, output[-4000:]
        assert "server1 did not answer /health_generate" in output and "; restart 1 of 3" in output, output[-4000:]
        for name in ("server0", "server1", "worker0"):  # from the actors of the second node
            lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
            assert lines[0].startswith("$ ") and len(lines) > 1, f"{name}.log holds {lines}"
            assert name == "worker0" or lines[1].startswith("inference server on http://127.0.0.2:"), lines
        restarted = (run_dir / "logs/server1.log").read_text()
        assert "===== restart 1 of 3: server1 did not answer /health_generate" in restarted
        assert (run_dir / "logs/trainer_rank1.log").exists(), "the ranks did not run in their own actors"

        out.seek(0)
        out.truncate()
        proc = launch(STEPS, resume=True)
        try:
            proc.wait(timeout=240)
        finally:
            output = stop_and_read(proc, out)
        assert proc.returncode == 0 and "resuming at step 2" in output, output[-4000:]
        import ray

        from launcher.ray import connect

        # the cluster is this machine's recorded one: without --address the launcher starts its own
        connect(None, load_config(None, []))
        try:
            assert ray.get_runtime_context().gcs_address != cluster.address
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    on_two, calm = fingerprint(run_dir), _calm(runs)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in rows]  # noqa: E731
    assert [r["step"] for r in on_two["metrics"]] == list(range(STEPS))
    assert strip(on_two["metrics"]) == strip(calm["metrics"])
    assert on_two["trajectories"] == calm["trajectories"]
    assert on_two["weights"] == calm["weights"]
