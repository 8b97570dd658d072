"""Placement of a job's processes on CPUs and GPUs (launcher/placement.py, areal_async/cpus.py)."""

import os
import subprocess
import sys
import time

import pytest

from areal_async.config import load_config
from areal_async.cpus import RANK_CPUS_ENV, divide, format_list, parse_list
from launcher.placement import cuda_visible_devices, place_job, refuse_on_ray
from launcher.supervisor import Supervisor

PY = sys.executable
ALL8 = frozenset(range(8))


def _place(overrides, allowed=ALL8, cpu_count=8, environ=None):
    return place_job(load_config(None, overrides), allowed, cpu_count, environ or {})


@pytest.mark.parametrize("text, cpus, folded", [
    ("", (), ""), ("0", (0,), "0"), ("0-3,8", (0, 1, 2, 3, 8), "0-3,8"),
    (" 3, 1,2 ", (1, 2, 3), "1-3"),  # order and spaces do not matter; a run folds
    ("1,1,0-1", (0, 1), "0-1"), ("5-5", (5,), "5"), ("0,2,4", (0, 2, 4), "0,2,4"),
])
def test_cpu_lists_parse_and_fold_as_linux_writes_them(text, cpus, folded):
    assert parse_list("k", text) == cpus
    assert format_list(cpus) == folded


@pytest.mark.parametrize("text, words", [
    ("a", "'a' is no index or range"), ("0-", "'0-' is no index"), ("-1", "'-1' is no index"),
    ("3-1", r"ends below its start; write it as \"1-3\""), ("0;1", "'0;1' is no index"),
    (" , ", "'' is no index"),
])
def test_a_malformed_list_names_the_key_and_the_notation(text, words):
    with pytest.raises(ValueError, match=rf"^inference.cpus='{text}': .*{words}"):
        _place([f'inference.cpus="{text}"'])


def test_a_cpu_outside_the_launchers_affinity_names_it_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"trainer.cpus='1,4': CPU 4 is not one this launcher may run on "
                                         r"\(allowed: 0-1,3, os.sched_getaffinity\)"):
        _place(['trainer.cpus="1,4"'], allowed=frozenset({0, 1, 3}))


def test_unset_keys_place_as_before_cpu_count_divided_nothing_pinned():
    # 8 CPUs, 1 server + 2 ranks: 8 // 3 = 2 threads each, as launcher.local always divided them
    placed = _place(["trainer.nproc=2"])
    assert [(s.cpus, s.threads) for s in placed.servers] == [((), 2)]
    assert placed.trainer.cpus == () and dict(placed.trainer.env) == {"OMP_NUM_THREADS": "2"}
    assert (placed.queue.cpus, dict(placed.queue.env), placed.workers.cpus) == ((), {}, ())
    assert not placed.pins and placed.warnings == []
    assert dict(_place([], environ={"OMP_NUM_THREADS": "3"}).trainer.env) == {"OMP_NUM_THREADS": "3"}
    assert _place(["inference.threads=5"]).servers[0].threads == 5


def test_two_cores_server_on_0_trainer_on_1_light_roles_float():
    placed = _place(['inference.cpus="0"', 'trainer.cpus="1"'], allowed=frozenset({0, 1}), cpu_count=2)
    assert [(s.cpus, s.threads) for s in placed.servers] == [((0,), 1)]
    assert placed.trainer.cpus == (1,)
    assert dict(placed.trainer.env) == {"OMP_NUM_THREADS": "1", RANK_CPUS_ENV: "1"}
    assert placed.queue.cpus == placed.workers.cpus == ()
    assert placed.pins and placed.warnings == []
    assert placed.describe() == ("server0 on CPUs 0 (1 thread(s)), trainer on CPUs 1 (OMP_NUM_THREADS=1), "
                                 "queue on any CPU, workers on any CPU")


def test_lists_are_divided_equally_among_servers_and_ranks_in_order():
    placed = _place(['inference.cpus="0-3"', "inference.num_servers=2", 'trainer.cpus="4-7"', "trainer.nproc=2",
                     'queue.cpus="7"', 'rollout.cpus="6-7"'])
    assert [(s.cpus, s.threads) for s in placed.servers] == [((0, 1), 2), ((2, 3), 2)]
    assert placed.trainer.cpus == (4, 5, 6, 7)  # torchrun; each rank pins itself to its part
    assert dict(placed.trainer.env) == {"OMP_NUM_THREADS": "2", RANK_CPUS_ENV: "4-5;6-7"}
    assert (placed.queue.cpus, dict(placed.queue.env)) == ((7,), {"OMP_NUM_THREADS": "1"})
    assert (placed.workers.cpus, dict(placed.workers.env)) == ((6, 7), {"OMP_NUM_THREADS": "2"})
    # explicit threads win over the part's size
    explicit = _place(['inference.cpus="0-3"', "inference.threads=1", 'trainer.cpus="4-5"'],
                      environ={"OMP_NUM_THREADS": "4"})
    assert explicit.servers[0].threads == 1 and explicit.trainer.env["OMP_NUM_THREADS"] == "4"
    with pytest.raises(ValueError, match=r"inference.cpus='0-2' names 3 CPU\(s\), which cannot be divided equally "
                                         r"among 2 servers \(inference.num_servers\); give a multiple of 2 CPUs"):
        _place(['inference.cpus="0-2"', "inference.num_servers=2"])
    assert divide("k", (0, 1, 2, 3, 4, 5), 3, "x") == [(0, 1), (2, 3), (4, 5)]


def test_servers_and_trainer_sharing_cpus_is_a_warning_not_an_error():
    placed = _place(['inference.cpus="0-1"', 'trainer.cpus="1-2"'])
    assert placed.warnings == ["inference.cpus='0-1' and trainer.cpus='1-2' share CPU(s) 1: the servers and the "
                               "trainer compete there; give them disjoint lists to keep them apart"]
    # the light roles may share anything without a warning
    assert _place(['inference.cpus="0"', 'trainer.cpus="1"', 'queue.cpus="0-1"', 'rollout.cpus="1"']).warnings == []


def test_server_on_cuda0_trainer_on_cuda1_resolves_to_the_trainers_visible_devices():
    from launcher.resolve import check_devices

    two_gpus = ["inference.device=cuda:0", "trainer.device=cuda", 'trainer.gpus="1"']
    check_devices(load_config(None, two_gpus), cuda_available=True)  # one GPU each: NCCL accepts it
    assert _place(two_gpus).trainer.env["CUDA_VISIBLE_DEVICES"] == "1"
    # the launcher's own CUDA_VISIBLE_DEVICES numbers its GPUs: its cuda:1 is physical GPU 0 here
    assert _place(two_gpus, environ={"CUDA_VISIBLE_DEVICES": "1,0"}).trainer.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert cuda_visible_devices((2, 3), "GPU-a, GPU-b,GPU-c,GPU-d") == "GPU-c,GPU-d"
    with pytest.raises(ValueError, match=r"cuda:1, but CUDA_VISIBLE_DEVICES='0' shows this launcher 1 GPU"):
        _place(two_gpus, environ={"CUDA_VISIBLE_DEVICES": "0"})
    assert "CUDA_VISIBLE_DEVICES" not in _place(["trainer.device=cuda"]).trainer.env  # unset: as before
    with pytest.raises(ValueError, match=r"cuda:1\) is also trainer rank 0's GPU .*trainer.gpus='1'"):
        check_devices(load_config(None, ["inference.device=cuda:1", "trainer.device=cuda", 'trainer.gpus="1"']),
                      cuda_available=True)
    with pytest.raises(ValueError, match=r"trainer.gpus='1' names 1 GPU\(s\) for trainer.nproc=2 rank\(s\)"):
        check_devices(load_config(None, [*two_gpus, "trainer.nproc=2"]), cuda_available=True)
    with pytest.raises(ValueError, match=r"trainer.gpus='1' but the trainer runs on the CPU"):
        check_devices(load_config(None, ['trainer.gpus="1"']), cuda_available=False)


def test_launcher_ray_refuses_the_placement_keys():
    refuse_on_ray(load_config(None, []))
    with pytest.raises(ValueError, match=r"^inference.cpus='0', trainer.gpus='1': launcher.ray does not pin"):
        refuse_on_ray(load_config(None, ['inference.cpus="0"', 'trainer.gpus="1"']))


# A child reports its own affinity, a thread's it started, and the kernel's view of it.
REPORT = ("import os, threading\n"
          "t = threading.Thread(target=lambda: print('thread', sorted(os.sched_getaffinity(0))))\n"
          "t.start(); t.join()\n"
          "print('process', sorted(os.sched_getaffinity(0)))\n"
          "print([l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')][0].strip())\n")


def _one_cpu() -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to tell a pinned child from an unpinned one")
    return allowed[-1]


def test_a_supervised_child_runs_on_its_cpus_and_so_do_its_threads(tmp_path):
    cpu = _one_cpu()
    sup = Supervisor(tmp_path / "logs")
    child = sup.start("server0", [PY, "-c", REPORT], expect_exit=True, cpus=(cpu,))
    deadline = time.monotonic() + 30
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop_all()
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert f"thread [{cpu}]\nprocess [{cpu}]\nCpus_allowed_list:\t{cpu}\n" in log, log


def test_a_trainer_rank_pins_itself_to_its_part_of_the_list():
    cpu = _one_cpu()
    others = format_list(sorted(os.sched_getaffinity(0) - {cpu}))
    code = "from areal_async.cpus import pin_rank; print('pinned', pin_rank())\n" + REPORT
    env = {**os.environ, RANK_CPUS_ENV: f"{others};{cpu}", "LOCAL_RANK": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == f"pinned ({cpu},)\nthread [{cpu}]\nprocess [{cpu}]\nCpus_allowed_list:\t{cpu}\n"


class _Recorder:
    """A supervisor that records what ``run_job`` starts, and where, instead of starting it."""

    env: dict = {}
    log_dir = "logs"

    def __init__(self):
        self.started = {}

    def start(self, name, argv, env=None, cpus=(), **kw):
        self.started[name] = (argv, env or {}, cpus)
        return name

    def check(self):
        pass

    def wait_for(self, child):
        return 0


def test_run_job_starts_each_process_on_its_place(tmp_path, monkeypatch):
    import launcher.local as local

    monkeypatch.setattr(local, "http_status", lambda url, timeout_s: 200)
    monkeypatch.setattr(local, "_port_open", lambda host, port: True)
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cfg = load_config(None, [f"run_root={tmp_path}", "inference.num_servers=2", 'inference.cpus="0-1"',
                             'trainer.cpus="2"', 'rollout.cpus="3"', "inference.base_port=9100",
                             "queue.port=9200", "trainer.master_port=9300"])
    sup = _Recorder()
    local.run_job(cfg, sup)
    argv = {name: started[0] for name, started in sup.started.items()}
    assert {name: started[2] for name, started in sup.started.items()} == {
        "server0": (0,), "server1": (1,), "queue": (), "trainer": (2,), "worker0": (3,)}
    assert [a[a.index("--threads") + 1] for a in (argv["server0"], argv["server1"])] == ["1", "1"]
    trainer_env = sup.started["trainer"][1]
    assert (trainer_env["OMP_NUM_THREADS"], trainer_env[RANK_CPUS_ENV]) == ("1", "2")
    assert sup.started["worker0"][1] == {"OMP_NUM_THREADS": "1"}
