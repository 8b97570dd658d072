"""The determinism proof on Ray: the job of ``tests/test_determinism.py`` under ``launcher.ray``
(each process in a Ray actor, one actor per trainer rank) on two Ray nodes of this host, with a
hung inference server (killed by the launcher's health check and restarted) and a ``--resume``
after step 2, must equal the ``launcher.local`` run (``det_runs``) bit for bit.
"""

import functools
import os
import subprocess

import pytest

from tests.support import REPO
from tests.support.chaos import generating, pids, wait
from tests.support.determinism import calm, strip_faults
from tests.support.jobs import STEPS, fingerprint, job_argv, stop_and_read


@pytest.mark.timeout(600)  # run alone (-k): it runs the launcher.local job too (det_runs)
def test_the_ray_launcher_on_two_nodes_survives_a_hung_server_resumes_and_equals_the_local_run(
        det_runs, tiny_model_dir, tmp_path, monkeypatch):
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
    on_two, undisturbed = fingerprint(run_dir), calm(det_runs)
    assert [r["step"] for r in on_two["metrics"]] == list(range(STEPS))
    assert strip_faults(on_two["metrics"]) == strip_faults(undisturbed["metrics"])
    assert on_two["trajectories"] == undisturbed["trajectories"]
    assert on_two["weights"] == undisturbed["weights"]
