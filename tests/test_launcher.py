"""Launcher supervision: a failing child stops the job with its last lines; nothing is orphaned; restarts
and their weights; signals. What is checked before anything starts: ``tests/test_launch_checks.py``."""

import os
import re
import sys
import time

import pytest

from areal_async.config import load_config
from launcher.servers import SERVER_ARGV
from launcher.supervisor import JobFailed, Supervisor

PY = sys.executable


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, not yet reaped
    except FileNotFoundError:
        return False


def _alive(pid: int, within_s: float = 5.0) -> bool:
    """True if ``pid`` is still running ``within_s`` seconds from now (SIGKILL is asynchronous)."""
    deadline = time.monotonic() + within_s
    while _running(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)
    return False


def test_failing_child_stops_job_with_its_last_lines(tmp_path):
    sup = Supervisor(tmp_path / "logs")
    # A long-lived child that starts a grandchild of its own (like torchrun's ranks).
    server = sup.start("server0", [PY, "-c", (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('grandchild', p.pid, flush=True)\n"
        "time.sleep(600)\n")])
    bad = sup.start("worker0", [PY, "-c", "print('loading'); print('[worker0] tagged by itself'); "
                                          "raise SystemExit('reward pool broke')"], expect_exit=True)
    while not any(line.startswith("grandchild") for line in server.tail):
        sup.check() if bad.poll() is None else None
        time.sleep(0.05)
    grandchild = int(next(l for l in server.tail if l.startswith("grandchild")).split()[1])
    with pytest.raises(JobFailed) as info:
        sup.wait_for(server, poll_s=0.05)
    msg = str(info.value)
    assert "worker0 exited with status 1" in msg
    assert "[worker0] reward pool broke" in msg and "[worker0] loading" in msg
    assert "  [worker0] tagged by itself" in msg and "[worker0] [worker0]" not in msg
    sup.stop_all(grace_s=2)
    assert not _alive(server.proc.pid) and not _alive(grandchild)
    assert (tmp_path / "logs" / "worker0.log").read_text().endswith(
        "\nloading\n[worker0] tagged by itself\nreward pool broke\n")


def test_unexpected_clean_exit_of_long_lived_child_is_a_failure(tmp_path):
    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    sup.start("queue", [PY, "-c", "print('bye')"])
    with pytest.raises(JobFailed, match="queue exited unexpectedly"):
        sup.wait_for(trainer, poll_s=0.05)
    sup.stop_all(grace_s=2)
    assert trainer.poll() is not None


def test_child_killed_by_a_signal_is_named(tmp_path):
    import signal

    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    worker = sup.start("worker0", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    os.kill(worker.proc.pid, signal.SIGKILL)
    with pytest.raises(JobFailed, match="worker0 was killed by SIGKILL"):
        sup.wait_for(trainer, poll_s=0.05)
    sup.stop_all(grace_s=2)


SLOW_CONVERSION = """
import sys, time
from areal_async.model import source

def convert(wheel, member, gguf_dir, out_dir):  # the built-in model's conversion, stuck
    gguf_dir.mkdir(parents=True)
    (gguf_dir / "model.gguf").write_bytes(bytes(1 << 20))
    print("converting", flush=True)
    time.sleep(600)

source._download_wheel = lambda spec, wheel_dir: wheel_dir / "fake.whl"
source._convert = convert
from launcher.local import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, inherited", [("SIGTERM", "default"), ("SIGINT", "default"), ("SIGINT", "ignored")])
def test_a_signal_during_start_up_unwinds_and_exits_130(tmp_path, sig, inherited):
    # SIGTERM killed the launcher outright (lock and temporary model directory left behind), SIGINT
    # printed a KeyboardInterrupt traceback, and an inherited ignored SIGINT was ignored
    import pathlib
    import queue
    import signal
    import subprocess
    import threading

    cache = tmp_path / "cache"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited == "ignored" else None
    proc = subprocess.Popen(
        [PY, "-c", SLOW_CONVERSION, "configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=exp",
         "model.path=smollm2-135m-instruct", f"model.cache_dir={cache}", "inference.num_servers=1"],
        cwd=pathlib.Path(__file__).parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=ignore)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)])
    reader.start()
    out = []
    try:
        while (line := lines.get(timeout=120)) is not None and line != "converting\n":
            out.append(line)
        assert line == "converting\n", "".join(out)
        assert (tmp_path / ".exp.lock").exists() and list(cache.glob(".smollm2-135m-instruct.tmp-*"))
        proc.send_signal(getattr(signal, sig))
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
        reader.join()
    out += list(iter(lines.get, None))
    text = "".join(out)
    assert rc == 130, text
    assert text.endswith("[launcher] interrupted; stopping every process\n") and "Traceback" not in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no lock, no run directory
    assert list(cache.iterdir()) == []  # no temporary model, no lock


def test_ctrl_c_leaves_a_clean_trainer_log(tmp_path, tiny_model_dir):
    # A clean Ctrl-C ended trainer.log with torchrun's SignalException traceback
    import pathlib
    import signal
    import subprocess

    argv = [PY, "-m", "launcher.local", "configs/gsm8k_smollm2.yaml", "name=c", f"run_root={tmp_path}",
            f"model.path={tiny_model_dir}", "model.dtype=float32", "data.max_prompt_len=400",
            "inference.max_seq_len=512", "inference.threads=1",
            "rollout.n_samples=2", "rollout.max_new_tokens=8", "queue.batch_size=2",
            "trainer.total_steps=1000", "eval.at_start=false", "eval.at_end=false", "eval.max_new_tokens=8",
            "reward.fn=tests.support.parity_reward:even_length", "logging.wandb_mode=disabled"]
    proc = subprocess.Popen(argv, cwd=pathlib.Path(__file__).parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "c" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists(), "no step was logged: " + (proc.stdout.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    trainer = (tmp_path / "c" / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer and "death signal" not in trainer, trainer[-3000:]
    assert trainer.endswith("[trainer] stopped by SIGTERM; ranks shut down\n"), trainer[-3000:]
    # torchrun's agent kept its directories in the run's logs, not in a /tmp/torchelastic_* of its own
    assert list((tmp_path / "c" / "logs" / "torchrun").glob("*/attempt_0")), "no torchrun log directory in the run"


def test_a_resumed_job_appends_to_the_logs_after_a_separator_line(tmp_path, monkeypatch):
    # --resume replaced every logs/*.log with the resumed job's
    import json

    import launcher.local
    from launcher.local import launch

    cfg = load_config(None, [f"run_root={tmp_path}", "name=r", "trainer.resume=true"])
    (tmp_path / "r" / "checkpoint").mkdir(parents=True)
    (tmp_path / "r" / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 4}))
    logs = tmp_path / "r" / "logs"
    logs.mkdir()
    (logs / "trainer.log").write_text("$ torchrun ...\nstep    3/10 | ...\n")

    def job(cfg, sup):
        child = sup.start("trainer", [PY, "-c", "print('step    4/10')"], expect_exit=True)
        sup.wait_for(child, poll_s=0.05)

    monkeypatch.setattr(launcher.local, "run_job", job)
    assert launch(cfg) == 0
    lines = (logs / "trainer.log").read_text().splitlines()
    assert lines[:2] == ["$ torchrun ...", "step    3/10 | ..."]  # the stopped job's, kept
    assert re.fullmatch(r"===== --resume at step 4, \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+ =====", lines[2]), lines[2]
    assert lines[3].startswith("$ ") and lines[4:] == ["step    4/10"]
    fresh = Supervisor(tmp_path / "fresh")  # a new job's logs start afresh
    (tmp_path / "fresh" / "x.log").write_text("old\n")
    child = fresh.start("x", [PY, "-c", "print('new')"], expect_exit=True)
    fresh.wait_for(child, poll_s=0.05)
    fresh.stop_all()
    assert (tmp_path / "fresh" / "x.log").read_text().splitlines()[1:] == ["new"]


def test_a_dying_child_with_a_restart_policy_is_restarted_a_bounded_number_of_times(tmp_path):
    # Like a worker whose reward function does not import: it dies at every start. Two restarts,
    # each after the policy's `before` (the queue's release), then the job stops with its error.
    from launcher.supervisor import Restart

    calls = []
    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    sup.start("worker0", [PY, "-c", "raise SystemExit('no module named rewardz')"], expect_exit=True,
              restart=Restart(2, lambda why: calls.append(why) or "groups [3] go back", backoff_s=0.05))
    t0 = time.monotonic()
    with pytest.raises(JobFailed, match=r"worker0 exited with status 1 after 2 restart\(s\)") as info:
        sup.wait_for(trainer, poll_s=0.02)
    assert time.monotonic() - t0 < 20
    assert "no module named rewardz" in str(info.value)
    assert calls == ["exited with status 1"] * 2
    sup.stop_all(grace_s=2)
    log = (tmp_path / "logs" / "worker0.log").read_text()
    assert log.count("\nno module named rewardz\n") == 3  # its output, not its command line
    assert re.findall(r"===== restart (\d) of 2: worker0 exited with status 1, ", log) == ["1", "2"]


def test_a_restarted_child_runs_on_and_a_dead_queue_still_stops_the_job(tmp_path):
    # worker0 is killed once and restarted (it then runs); then the queue dies: the job stops
    # with the queue's error, not the worker's, though the next worker death cannot be handled.
    import signal

    from launcher.supervisor import Restart

    def release(why):
        if queue.poll() is not None:
            raise ConnectionError("replay queue not reachable")
        return ""

    sup = Supervisor(tmp_path / "logs")
    # the worker first, so that check() meets its death before the queue's
    worker = sup.start("worker0", [PY, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                       expect_exit=True, restart=Restart(3, release, backoff_s=0.05))
    queue = sup.start("queue", [PY, "-c", "import sys, time; time.sleep(600)"])
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    first = worker.proc.pid
    os.kill(first, signal.SIGKILL)
    while worker.proc.pid == first or "up" not in worker.tail:
        sup.check()
        time.sleep(0.02)
    assert worker.restarts == 1 and worker.proc.poll() is None
    queue.proc.kill()
    os.kill(worker.proc.pid, signal.SIGKILL)  # a worker dying of the lost queue, noticed first
    queue.proc.wait()
    with pytest.raises(JobFailed, match="queue was killed by SIGKILL"):
        while True:
            sup.check()
            time.sleep(0.02)
    sup.stop_all(grace_s=2)
    assert trainer.poll() is not None


def test_a_child_failing_its_health_check_is_killed_and_restarted_then_stops_the_job(tmp_path):
    # Like a hung server: alive, answers /health, never /health_generate. Each start is killed by
    # the check and restarted once; the second hang stops the job with the check's words.
    from launcher.supervisor import HealthCheck, Restart

    asked = []

    def probe(path: str, timeout_s: float) -> str | None:
        asked.append(path)
        return None if path == "/health" else f"no answer within {timeout_s:g} s"

    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    server = sup.start("server0", [PY, "-c", "import time; print('serving', flush=True); time.sleep(600)"],
                       restart=Restart(1, lambda why: f"counted: {why}", backoff_s=0.05),
                       health=HealthCheck(probe, interval_s=0.1, startup_timeout_s=5))
    first = server.proc.pid
    with pytest.raises(JobFailed, match=r"server0 did not answer /health_generate: no answer within 0.1 s "
                                        r"\(killed\) after 1 restart\(s\)"):
        sup.wait_for(trainer, poll_s=0.02)
    assert server.proc.pid != first and not _alive(first, within_s=0.1)
    assert asked[0] == "/health" and asked.count("/health_generate") == 2
    sup.stop_all(grace_s=2)
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert "===== restart 1 of 1: server0 did not answer /health_generate: no answer within 0.1 s (killed), " in log


def test_a_server_that_does_not_come_up_after_a_restart_is_killed(tmp_path):
    from launcher.supervisor import HealthCheck

    sup = Supervisor(tmp_path / "logs")
    sup.start("server0", [PY, "-c", "import time; time.sleep(600)"],
              health=HealthCheck(lambda path, timeout_s: "Connection refused", interval_s=0.1, startup_timeout_s=0.3))
    with pytest.raises(JobFailed, match=r"server0 did not answer /health within 0.3 s of its start: "
                                        r"Connection refused \(killed\)"):
        while True:
            sup.check()
            time.sleep(0.02)
    sup.stop_all(grace_s=2)


def test_a_server_death_that_cannot_be_survived_stops_the_job_naming_the_fix(tmp_path):
    from launcher.servers import server_failed

    cfg = load_config(None, ["trainer.weight_sync=distributed", "inference.num_servers=2"])
    with pytest.raises(RuntimeError, match="it died while the job was starting"):  # not refused: its group is rebuilt
        server_failed(cfg, None, Supervisor(tmp_path / "logs"), 0, "was killed by SIGKILL")
    for n in (1, 2):  # disk sync: one server is restarted too, from the newest weights (not refused)
        cfg = load_config(None, ["trainer.weight_sync=disk", f"inference.num_servers={n}"])
        with pytest.raises(RuntimeError, match="it died while the job was starting"):
            server_failed(cfg, None, Supervisor(tmp_path / "logs"), 0, "was killed by SIGKILL")


def _hf_dir(path, marker: str):
    """A stand-in for a version directory as ``write_hf_directory`` leaves it (two files)."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text(marker)
    (path / "config.json").write_text("{}")
    return path


def test_a_restart_pins_the_newest_complete_weights_directory(tmp_path):
    from launcher.restart_weights import complete_versions, pin

    weights, pins = tmp_path / "weights", tmp_path / "restart_weights" / "server0"
    assert pin(weights, pins) is None  # no directory yet: the original command line
    _hf_dir(weights / "v1", "one")
    _hf_dir(weights / "v3", "three")
    _hf_dir(weights / "v7.partial", "being written")  # write_hf_directory's staging name
    _hf_dir(weights / "v5.removed", "being removed")  # atomic_dir.remove_atomically's
    _hf_dir(weights / "v9x", "not a version")
    (weights / "v8").write_text("a file, not a directory")
    assert [v for v, _ in complete_versions(weights)] == [3, 1]
    version, path = pin(weights, pins)
    assert (version, path) == (3, pins / "v3")
    assert (path / "model.safetensors").read_text() == "three"
    assert (path / "model.safetensors").stat().st_ino == (weights / "v3/model.safetensors").stat().st_ino  # linked
    from areal_async.atomic_dir import remove_atomically

    remove_atomically(weights / "v3")  # the trainer moved on: the pinned files stay readable
    assert not (weights / "v3").exists() and (path / "model.safetensors").read_text() == "three"
    assert pin(weights, pins) == (1, pins / "v1") and not (pins / "v3").exists()  # the previous pin went


def test_a_version_removed_while_it_is_pinned_gives_way_to_the_newer_one(tmp_path, monkeypatch):
    # The trainer publishes v4 and removes v3 between the launcher's listing and its links: the
    # link fails, and the newest version then, v4, is pinned instead.
    import launcher.restart_weights as rw
    from areal_async.atomic_dir import remove_atomically

    weights, pins = tmp_path / "weights", tmp_path / "pins"
    _hf_dir(weights / "v3", "three")
    _hf_dir(weights / "v4.partial", "four")
    real_link, calls = os.link, []

    def link(src, dst):
        if not calls:  # the trainer's next update lands just now
            (weights / "v4.partial").rename(weights / "v4")
            remove_atomically(weights / "v3")
        calls.append(src)
        real_link(src, dst)

    monkeypatch.setattr(rw.os, "link", link)
    assert rw.pin(weights, pins) == (4, pins / "v4")
    assert sorted(p.name for p in pins.iterdir()) == ["v4"] and (pins / "v4/model.safetensors").read_text() == "four"
    assert str(weights / "v3") in str(calls[0])


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_a_restarted_server_starts_from_the_newest_weights_at_their_version(tmp_path, backend):
    import functools

    from launcher.servers import _server_argv, restart_argv

    cfg = load_config(None, [f"inference.backend={backend}", "inference.base_port=31000"])
    argv = functools.partial(_server_argv, SERVER_ARGV[backend], cfg.inference, 31000, "deterministic", 1,
                             cfg.debug, None)

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    first = restart_argv(tmp_path, 0, argv, cfg.model, 0)  # no update yet: as it first started
    assert first == argv(cfg.model, 0) and flag(first, "--model-path") == cfg.model.path
    import msgspec

    ckpt = msgspec.structs.replace(cfg.model, path=str(tmp_path / "checkpoint"))  # a resumed job's, at step 4
    assert restart_argv(tmp_path, 0, argv, ckpt, 4) == argv(ckpt, 4)
    _hf_dir(tmp_path / "weights" / "v5", "five")
    _hf_dir(tmp_path / "weights" / "v6.partial", "six, half written")
    again = restart_argv(tmp_path, 1, argv, ckpt, 4)
    pinned = tmp_path / "restart_weights" / "server1" / "v5"
    assert flag(again, "--model-path") == str(pinned.resolve()) and flag(again, "--weight-version") == "5"
    module = "sglang.launch_server" if backend == "sglang" else "areal_async.embedded.server"
    assert again[1:3] == ["-m", module]
    assert [a for a in again if a not in (str(pinned.resolve()), "5")] == [
        a for a in first if a not in (cfg.model.path, "0")], "only the weights and their version change"


def test_a_new_job_never_restarts_a_server_from_a_stopped_jobs_weights(tmp_path):
    # a stopped job trained to version 7; its checkpoint (what --resume continues) is at step 4
    from launcher.servers import remove_stale_weights
    from launcher.restart_weights import pin

    _hf_dir(tmp_path / "weights" / "v7", "seven")
    _hf_dir(tmp_path / "restart_weights" / "server0" / "v6", "six")
    remove_stale_weights(tmp_path)
    assert pin(tmp_path / "weights", tmp_path / "restart_weights" / "server0") is None
    assert not (tmp_path / "restart_weights").exists()


def test_a_restart_policy_gives_each_restart_its_command_line(tmp_path):
    from launcher.supervisor import Restart

    starts = iter(["second", "third"])
    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    sup.start("server0", [PY, "-c", "print('first'); raise SystemExit(3)"],
              restart=Restart(2, lambda why: "", backoff_s=0.05,
                              argv=lambda: [PY, "-c", f"print({next(starts)!r}); raise SystemExit(3)"]))
    with pytest.raises(JobFailed, match=r"server0 exited with status 3 after 2 restart\(s\)"):
        sup.wait_for(trainer, poll_s=0.02)
    sup.stop_all(grace_s=2)
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert [line for line in log.splitlines() if line in ("first", "second", "third")] == ["first", "second", "third"]

    def no_weights():
        raise OSError(28, "No space left on device")

    sup = Supervisor(tmp_path / "logs2")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    sup.start("server0", [PY, "-c", "raise SystemExit(3)"], restart=Restart(2, lambda why: "", backoff_s=0.05,
                                                                            argv=no_weights))
    with pytest.raises(JobFailed, match=r"server0 exited with status 3 after 1 restart\(s\), and it cannot be "
                                        r"restarted: \[Errno 28\] No space left on device"):
        sup.wait_for(trainer, poll_s=0.02)
    sup.stop_all(grace_s=2)


def test_only_the_first_signal_interrupts_so_a_second_cannot_break_off_the_stop(capsys):
    # GNU timeout sends SIGTERM to the launcher and again to its process group: the second one
    # used to raise KeyboardInterrupt inside the stop the first one started.
    import os
    import signal

    from launcher.local import interrupt_on_signals

    stopped = False
    with interrupt_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not interrupt")
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGTERM)  # during the stop
            os.kill(os.getpid(), signal.SIGINT)
            stopped = True
    assert stopped
    err = capsys.readouterr().err
    assert "SIGTERM again: still stopping every process" in err and "SIGINT again" in err




def test_a_trainer_rank_whose_torchrun_died_before_the_rank_started_exits():
    # A launcher killed with SIGKILL while the ranks imported left a rank running, blocked, for good:
    # torchrun had already died with it, so the rank read init as its parent and tied no death to it
    import subprocess

    from tests.support import REPO

    rank = ("import time; time.sleep(1); from areal_async.trainer.main import _die_with_parent; "
            "_die_with_parent(); print('alive', flush=True)")
    torchrun = ("import os, subprocess, sys; os.environ['AREAL_ASYNC_TORCHRUN_PID'] = str(os.getpid()); "
                f"subprocess.Popen([sys.executable, '-c', {rank!r}])")  # exits at once, as if killed
    out = subprocess.run([sys.executable, "-c", torchrun], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "alive" not in out.stdout  # the pipe closes when the rank exits too
