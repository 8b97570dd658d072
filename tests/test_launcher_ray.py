"""``launcher.ray``: the placement it asks for, where the servers and the queue listen, the
trainer ranks' command line, the interface every child kind shares with ``Child``, and faults.

That a Ray job on two Ray nodes equals ``launcher.local``'s bit for bit is tested in
``test_determinism_ray.py``; a job ended by a lost actor, a dead queue or SIGTERM in
``test_launcher_ray_faults.py``. A server in an actor that fails its health check is killed
through the actor and restarted. An actor that dies inside ``start`` (made certain:
``DiesInStart``) is a death too: restarted by the worker's policy, and, dying at every start, the
end of the job once its restarts are spent.
"""

import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

pytest.importorskip("ray", reason="launcher.ray needs Ray: pip install -e '.[dev]'")

from areal_async.config import load_config  # noqa: E402
from launcher.local import PY  # noqa: E402
from launcher.ray import RankGroup, RayChild, _rank_argv, bind_hosts, bundles_of  # noqa: E402
from launcher.ray_actor import ProcessActor  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.support.jobs import job_argv  # noqa: E402
from tests.support.procs import pids_running, processes  # noqa: E402


def test_one_bundle_per_process_with_the_cluster_sections_resources():
    cfg = load_config(None, ["inference.num_servers=2", "trainer.nproc=2", "rollout.num_workers=3",
                             "cluster.cpus_per_server=2", "cluster.gpus_per_trainer_rank=1",
                             "cluster.cpus_per_queue=0.5", "cluster.worker_node=10.0.0.7"])
    index, resources = bundles_of(cfg)
    assert index == {"server": [0, 1], "queue": [2], "trainer": [3, 4], "worker": [5, 6, 7]}
    assert resources[:5] == [{"CPU": 2.0}] * 2 + [{"CPU": 0.5}] + [{"CPU": 1.0, "GPU": 1.0}] * 2
    # pinned: a sliver of the node's own resource, which only the node with that address has
    assert resources[5:] == [{"CPU": 1.0, "node:10.0.0.7": 0.001}] * 3


def test_a_rank_runs_the_module_that_torchrun_would_start():
    # the trainer's command line as launcher.local.run_job builds it
    torchrun = [PY, "-m", "launcher.torchrun", "--nproc-per-node", "2", "--master-port", "4321",
                "-m", "areal_async.trainer.main", "--config", "runs/x/config.yaml"]
    assert _rank_argv(torchrun) == (2, 4321, [PY, "-u", "-m", "areal_async.trainer.main",
                                              "--config", "runs/x/config.yaml"])


class FakePlacement:
    """Where ``bind_hosts`` reads the placement: bundle i on ``ips[i]``; ``taken``: ports in use
    on their node, as the actor made ahead for the bundle would find them."""

    def __init__(self, cfg, ips: list[str], driver_ip: str | None, taken: dict[int, str] = {}):
        self.bundles, _ = bundles_of(cfg)
        self.node_of = [(f"node-{ip}", ip) for ip in ips]
        self.driver_ip, self.taken, self.asked = driver_ip, taken, []

    def ask(self, bundle: int, method: str, host: str, port: int):
        assert method == "port_in_use"
        self.asked.append((self.node_of[bundle][1], host, port))
        return self.taken.get(port)


def test_the_servers_and_the_queue_listen_on_their_nodes_address_when_callers_are_elsewhere():
    from launcher.supervisor import JobFailed

    # 2 servers, the queue, 1 trainer rank, 1 worker: bundles 0, 1 | 2 | 3 | 4
    cfg = load_config(None, ["inference.num_servers=2", "trainer.nproc=1", "rollout.num_workers=1",
                             "inference.base_port=4100", "queue.port=4200"])
    a, b = "10.0.0.1", "10.0.0.2"
    one_host = FakePlacement(cfg, [a] * 5, a)
    assert bind_hosts(cfg, one_host) is cfg and not one_host.asked  # loopback reaches every process
    # the servers and the worker on b, the queue and the trainer with the launcher on a
    split = FakePlacement(cfg, [b, b, a, a, b], a)
    placed = bind_hosts(cfg, split)
    assert (placed.inference.host, placed.queue.host) == (b, a)
    assert placed.inference.urls() == [f"http://{b}:4100", f"http://{b}:4101"]
    assert split.asked == [(b, b, 4100), (b, b, 4101), (a, a, 4200)], "each port checked on its node"
    given = load_config(None, ["inference.num_servers=2", "trainer.nproc=1", "rollout.num_workers=1",
                               f"inference.host={b}"])
    assert bind_hosts(given, FakePlacement(given, [b, b, a, a, a], a)).inference.host == b
    with pytest.raises(JobFailed, match=r"the servers landed on nodes 10.0.0.1, 10.0.0.2, .*cluster.server_node="):
        bind_hosts(cfg, FakePlacement(cfg, [a, b, a, a, a], a))
    with pytest.raises(JobFailed, match=r"inference.host=10.0.0.2, but the servers run on node 10.0.0.3"):
        bind_hosts(given, FakePlacement(given, ["10.0.0.3"] * 2 + [a] * 3, a))
    with pytest.raises(JobFailed, match=r"port 4101 \(inference.base_port\+1\) is in use on node 10.0.0.2 "
                                        r"\(Address already in use\); set inference.base_port="):
        bind_hosts(cfg, FakePlacement(cfg, [b, b, a, a, a], a, taken={4101: "Address already in use"}))
    # Ray Client: the launcher shares no host with any node
    assert bind_hosts(cfg, FakePlacement(cfg, [a] * 5, None)).inference.host == a


def test_the_weight_groups_rendezvous_listens_on_rank_0s_node_when_servers_are_on_another_host():
    from launcher.supervisor import JobFailed

    over = ["inference.num_servers=2", "trainer.nproc=1", "rollout.num_workers=1", "trainer.weight_sync_port=4300"]
    cfg = load_config(None, over)
    a, b = "10.0.0.1", "10.0.0.2"
    assert bind_hosts(cfg, FakePlacement(cfg, [a] * 5, a)).trainer.weight_sync_host == "127.0.0.1"
    split = FakePlacement(cfg, [b, b, a, a, b], a)  # the servers on b, trainer rank 0 (bundle 3) on a
    assert bind_hosts(cfg, split).trainer.weight_sync_host == a
    assert (a, a, 4300) in split.asked, "the store's port is checked on rank 0's node"
    disk = load_config(None, [*over, "trainer.weight_sync=disk"])  # no group: nothing to bind
    assert bind_hosts(disk, FakePlacement(disk, [b, b, a, a, b], a)).trainer.weight_sync_host == "127.0.0.1"
    given = load_config(None, [*over, f"trainer.weight_sync_host={b}"])
    with pytest.raises(JobFailed, match=r"trainer.weight_sync_host=10.0.0.2, but trainer rank 0 runs on node "
                                        r"10.0.0.1, .*cluster.trainer_node=10.0.0.2"):
        bind_hosts(given, FakePlacement(given, [b, b, a, a, b], a))
    with pytest.raises(JobFailed, match=r"port 4300 \(trainer.weight_sync_port\) is in use on node 10.0.0.1"):
        bind_hosts(cfg, FakePlacement(cfg, [b, b, a, a, b], a, taken={4300: "Address already in use"}))


class FakeRank:
    def __init__(self, name: str):
        self.name, self.rc, self.echo, self.actor_error = name, None, False, None
        self.log_path, self.tail = pathlib.Path(f"{name}.log"), [f"{name}'s last line"]

    def poll(self):
        return self.rc


def test_the_ranks_run_as_one_child_as_under_torchrun():
    ranks = [FakeRank("trainer"), FakeRank("trainer_rank1")]
    group = RankGroup(ranks)
    ranks[0].rc = 0
    assert group.poll() is None, "rank 1 still runs"
    ranks[1].rc = -9  # rank 1 killed: the group fails with its status, name, log and lines
    assert group.poll() == -9
    assert (group.name, group.log_path, group.tail) == ("trainer (rank 1)", ranks[1].log_path,
                                                        ["trainer_rank1's last line"])
    done = [FakeRank("trainer"), FakeRank("trainer_rank1")]
    for rank in done:
        rank.rc = 0
    assert RankGroup(done).poll() == 0 and RankGroup(done).name == "trainer"


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance in this process, for the tests that make actors here."""
    import ray

    # no idle workers started ahead: every actor here gets a worker process of its own anyway
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
    yield ray
    ray.shutdown()


def test_the_log_of_an_actor_on_another_node_is_copied_to_the_launchers(local_ray, tmp_path, capsys):
    # one node here: the actor is treated as remote (local_log=False), so it writes a log of its
    # own node's and the launcher pulls the lines into logs/<name>.log, and echoes them
    ray = local_ray
    child = RayChild("echoer", [PY, "-c", "print('one'); print('two')"],
                     lambda: ray.remote(ProcessActor).options(num_cpus=0.5).remote(), tmp_path,
                     dict(os.environ), local_log=False, echo=True, expect_exit=True)
    deadline = time.monotonic() + 60
    while child.poll() is None:
        assert time.monotonic() < deadline, "the child did not exit within 60 s"
        time.sleep(0.05)
    assert child.poll() == 0
    theirs = ray.get(child.actor.read_log.remote(0))[0]
    node_dir = pathlib.Path(child.remote_log).parent
    assert node_dir != tmp_path and node_dir.is_dir()
    child.stop(1.0)
    ours = (tmp_path / "echoer.log").read_text()
    assert ours == theirs and ours.splitlines()[1:] == ["one", "two"] and ours.startswith("$ ")
    assert not node_dir.exists(), f"the actor's node-local log directory {node_dir} outlived the job"
    assert capsys.readouterr().out == "one\ntwo\n"


def test_a_server_failing_its_health_check_in_its_actor_is_killed_and_restarted(local_ray, tmp_path):
    # as test_launcher's check of a Child: alive, answers /health, never /health_generate; the
    # supervisor kills it through its actor and starts it again, once; the second hang ends the job
    ray = local_ray
    from launcher.supervisor import HealthCheck, JobFailed, Restart, Supervisor

    asked = []

    def probe(path: str, timeout_s: float) -> str | None:
        asked.append(path)
        return None if path == "/health" else f"no answer within {timeout_s:g} s"

    sup = Supervisor(tmp_path / "logs")
    try:
        make = lambda: ray.remote(ProcessActor).options(num_cpus=0.5).remote()  # noqa: E731
        trainer = RayChild("trainer", [PY, "-c", "import time; time.sleep(600)"], make, sup.log_dir,
                           dict(os.environ), local_log=True, expect_exit=True)
        server = RayChild("server0", [PY, "-c", "import time; print('serving', flush=True); time.sleep(600)"],
                          make, sup.log_dir, dict(os.environ), local_log=True,
                          restart=Restart(1, lambda why: "counted", backoff_s=0.05),
                          health=HealthCheck(probe, interval_s=0.1, startup_timeout_s=30))
        sup.children += [trainer, server]
        first = server.pid
        with pytest.raises(JobFailed, match=r"server0 did not answer /health_generate: no answer within 0.1 s "
                                            r"\(killed\) after 1 restart\(s\)"):
            sup.wait_for(trainer, poll_s=0.02)
        assert asked[0] == "/health" and asked.count("/health_generate") == 2
        assert server.poll() == -9 and first not in processes(), "the check's SIGKILL did not reach the process"
    finally:
        sup.stop_all(grace_s=1)
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert "===== restart 1 of 1: server0 did not answer /health_generate: no answer within 0.1 s (killed), " in log


class DiesInStart(ProcessActor):
    """A ``ProcessActor`` whose Ray worker process is SIGKILLed inside ``start``, once the process
    is started and before ``start`` returns: the moment a kill of a just-started worker's actor
    (a lost node) can land in, made certain."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)


def _actors(ray, dying: int):
    """``make_actor`` for a ``RayChild`` whose first ``dying`` actors die in ``start``; the list of
    the actors made so far (which kind each was)."""
    made = []

    def make():
        made.append("dies" if len(made) < dying else "lives")
        return ray.remote(DiesInStart if made[-1] == "dies" else ProcessActor).options(num_cpus=0.5).remote()

    return make, made


def test_a_worker_whose_actor_dies_while_it_starts_is_restarted_by_its_policy(local_ray, tmp_path):
    # as any later death of its actor: counted, its groups handed back (before), started again in a
    # new actor, its log going on after the restart line; the process of the dead actor died with it
    from launcher.ray import RaySupervisor
    from launcher.supervisor import Restart

    make, made = _actors(local_ray, dying=1)
    released = []
    marker = f"worker-of-{tmp_path.name}"
    sup = RaySupervisor(tmp_path / "logs", placement=None)  # its children are made here, not placed
    try:
        worker = RayChild("worker0", [PY, "-c", "import time; print('generating', flush=True); time.sleep(600)",
                                      marker], make, sup.log_dir, dict(os.environ), local_log=True,
                          expect_exit=True, restart=Restart(3, lambda why: released.append(why) or "groups [] go back",
                                                            backoff_s=0.05))
        sup.children.append(worker)
        assert worker.poll() == -9 and worker.actor_error.startswith("lost its Ray actor while it started")
        deadline = time.monotonic() + 60
        while worker.restarts == 0 or worker.restart_at is not None:  # died, scheduled, started again
            sup.check()
            assert time.monotonic() < deadline, "worker0 was not started again within 60 s"
            time.sleep(0.02)
        assert made == ["dies", "lives"] and worker.poll() is None
        assert len(released) == 1 and released[0].startswith("lost its Ray actor while it started (")
        assert pids_running(marker) == [worker.pid], "the first actor's process outlived it"
    finally:
        sup.stop_all(grace_s=1)
    log = (tmp_path / "logs" / "worker0.log").read_text()
    assert "===== restart 1 of 3: worker0 lost its Ray actor while it started (" in log, log


def test_a_worker_that_can_never_start_stops_the_job_after_its_restarts(local_ray, tmp_path):
    # every actor dies in start: restarted as allowed, then the job stops naming the worker; a
    # child with no policy (the queue) stops it at its first such death
    from launcher.ray import RaySupervisor
    from launcher.supervisor import JobFailed, Restart

    make, made = _actors(local_ray, dying=99)
    released = []
    sup = RaySupervisor(tmp_path / "logs", placement=None)
    try:
        sup.children.append(RayChild("worker0", [PY, "-c", "import time; time.sleep(600)"], make, sup.log_dir,
                                     dict(os.environ), local_log=True, expect_exit=True,
                                     restart=Restart(1, released.append, backoff_s=0.05)))
        deadline = time.monotonic() + 60
        with pytest.raises(JobFailed, match=r"^worker0 lost its Ray actor while it started \(.*\) "
                                            r"after 1 restart\(s\)"):
            while time.monotonic() < deadline:
                sup.check()
                time.sleep(0.02)
        assert made == ["dies"] * 2 and len(released) == 1
    finally:
        sup.stop_all(grace_s=1)
    make, made = _actors(local_ray, dying=1)
    sup = RaySupervisor(tmp_path / "logs", placement=None)
    try:
        sup.children.append(RayChild("queue", [PY, "-c", "import time; time.sleep(600)"], make, sup.log_dir,
                                     dict(os.environ), local_log=True))
        with pytest.raises(JobFailed, match=r"^queue lost its Ray actor while it started \("):
            sup.check()
        assert made == ["dies"]
    finally:
        sup.stop_all(grace_s=1)


def test_the_placement_keys_of_launcher_local_are_refused_before_anything_starts(tmp_path, capsys):
    from launcher.ray import main

    assert main(["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", 'inference.cpus="0"']) == 2
    assert "inference.cpus='0': launcher.ray does not pin processes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run lock, no run directory


def test_every_child_kind_is_what_the_supervisor_asks_of_a_child():
    from launcher.supervisor import Child, Supervised
    from tests.support.protocols import check_calls

    for cls in (Child, RayChild, RankGroup):
        check_calls(Supervised, cls)
    # and structurally, with the attributes an instance sets
    group = RankGroup([FakeRank("trainer")])
    assert isinstance(group, Supervised)
    missing = [name for name in Supervised.__annotations__ if not hasattr(group, name)]
    assert not missing, f"RankGroup lacks {missing}"


STANDIN_SGLANG = '''\
"""A stand-in for ``python -m sglang.launch_server`` (SGLang cannot run here): records its command
line, then serves it with the embedded server, which takes every flag the launcher gives SGLang."""
import json, os, runpy, sys
with open(os.environ["STANDIN_SGLANG_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
runpy.run_module("areal_async.embedded.server", run_name="__main__", alter_sys=True)
'''


def test_the_sglang_backend_runs_sglangs_command_line_in_each_servers_actor(tiny_model_dir, tmp_path):
    # inference.backend=sglang under launcher.ray: each server's actor runs `python -m
    # sglang.launch_server` with the flags launcher.local gives it (here answered by the stand-in),
    # and the job trains through them (one trainer rank: two ranks in two actors: test_launcher_ray_faults.py).
    standin = tmp_path / "standin"
    (standin / "sglang").mkdir(parents=True)
    (standin / "sglang" / "__init__.py").write_text("")
    (standin / "sglang" / "launch_server.py").write_text(STANDIN_SGLANG)
    log = tmp_path / "sglang_argv.jsonl"
    token = "-a-token-that-starts-with-a-dash"  # as token_urlsafe makes once in 64 launches
    env = {**os.environ, "PYTHONPATH": f"{standin}{os.pathsep}{REPO}", "STANDIN_SGLANG_LOG": str(log),
           "AREAL_ASYNC_TOKEN": token}
    argv = job_argv(tiny_model_dir, tmp_path, "sglang", "deterministic", 1, steps=1,
                    extra=("rollout.num_workers=1", "trainer.nproc=1", "inference.backend=sglang"), launcher="ray")
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(starts) == 2, starts
    cfg = load_config(tmp_path / "sglang" / "config.yaml")
    ports = sorted(int(s["argv"][s["argv"].index("--port") + 1]) for s in starts)
    assert ports == [cfg.inference.base_port, cfg.inference.base_port + 1]
    for start in starts:
        a = start["argv"]
        assert a[a.index("--model-path") + 1] == str(tiny_model_dir) and a[a.index("--host") + 1] == "127.0.0.1"
        assert "--enable-deterministic-inference" in a and a[a.index("--weight-version") + 1] == "0"
        assert [x for x in a if x.startswith("--api-key=")] == [f"--api-key={token}"], "the job's token is not --api-key"
    assert "[launcher] done" in proc.stdout + proc.stderr
