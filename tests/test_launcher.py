"""Launcher supervision: a failing child stops the job with its last lines; nothing is orphaned."""

import os
import re
import sys
import time

import pytest

from areal_async.config import load_config
from areal_async.determinism import deterministic_env
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


def test_server_command_lines():
    cfg = load_config(None, ["inference.num_servers=2", "inference.base_port=31000",
                             "inference.sglang_args=[--tp,'1']"])
    assert cfg.inference.urls() == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    emb = SERVER_ARGV["embedded"](cfg.inference, cfg.model, 31001, "deterministic", 1)
    assert emb[1:3] == ["-m", "areal_async.embedded.server"]
    assert emb[emb.index("--port") + 1] == "31001"
    assert "--enable-deterministic-inference" in emb and "--debug-jitter-ms" not in emb
    emb_tp = SERVER_ARGV["embedded"](cfg.inference, cfg.model, 31001, "throughput", 1)
    assert "--enable-deterministic-inference" not in emb_tp
    sgl = SERVER_ARGV["sglang"](cfg.inference, cfg.model, 31000, "throughput", 1)
    assert sgl[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-deterministic-inference" not in sgl and sgl[-2:] == ["--tp", "1"]
    assert sgl[sgl.index("--weight-version") + 1] == "0"
    det = SERVER_ARGV["sglang"](cfg.inference, cfg.model, 31000, "deterministic", 1)
    assert "--enable-deterministic-inference" in det
    assert sgl[sgl.index("--model-path") + 1] == cfg.model.path
    # the prefix cache: on by default (both backends), its size passed to the embedded server
    assert "--disable-radix-cache" not in emb + sgl and emb[emb.index("--prefix-cache-entries") + 1] == "8"
    off = load_config(None, ["inference.prefix_cache=false", "inference.prefix_cache_entries=3"]).inference
    emb_off = SERVER_ARGV["embedded"](off, cfg.model, 31001, "throughput", 1)
    assert "--disable-radix-cache" in emb_off and emb_off[emb_off.index("--prefix-cache-entries") + 1] == "3"
    assert "--disable-radix-cache" in SERVER_ARGV["sglang"](off, cfg.model, 31000, "throughput", 1)


def test_jitter_flags_and_deterministic_env():
    cfg = load_config(None, ["mode=deterministic", "debug.jitter_ms=5", "debug.jitter_seed=7"])
    emb = SERVER_ARGV["embedded"](cfg.inference, cfg.model, 31001, cfg.mode, 1, cfg.debug)
    flags = dict(zip(emb[emb.index("--debug-jitter-ms")::2], emb[emb.index("--debug-jitter-ms") + 1::2]))
    assert flags == {"--debug-jitter-ms": "5.0", "--debug-jitter-seed": "7", "--debug-jitter-stream": "31001"}
    env = deterministic_env(cfg.mode, environ={})
    assert env == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert deterministic_env(cfg.mode, environ={"NCCL_ALGO": "Tree"})["NCCL_ALGO"] == "Tree"  # a set value wins
    assert deterministic_env(load_config(None, ["mode=throughput"]).mode) == {}


def test_ports_in_use_or_shared_are_named():
    import socket

    from launcher.local import check_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = []
        for _ in range(3):  # the other ports: free ones, not the defaults (another job may hold those)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                free.append(s.getsockname()[1])
        cfg = load_config(None, [f"queue.port={port}", f"inference.base_port={free[0]}",
                                 f"trainer.master_port={free[1]}", f"trainer.weight_sync_port={free[2]}"])
        with pytest.raises(ValueError, match=f"port {port} \\(queue.port\\) is already in use"):
            check_ports(cfg)
    cfg = load_config(None, ["inference.num_servers=2", "inference.base_port=31000",
                             "queue.port=31001"])
    with pytest.raises(ValueError, match="queue.port and inference.base_port\\+1 are both port 31001"):
        check_ports(cfg)


def test_one_launcher_per_run_name(tmp_path):
    from launcher.local import lock_run

    cfg = load_config(None, ["name=exp", f"run_root={tmp_path}"])
    with lock_run(cfg):
        with pytest.raises(ValueError, match="run 'exp' .* is in use by another launcher"):
            with lock_run(cfg):
                pass
    with lock_run(cfg):
        pass


def test_the_launcher_removes_its_run_lock_however_it_exits(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import launcher.local
    from launcher.local import lock_run, main
    from launcher.supervisor import JobFailed

    lock = tmp_path / ".exp.lock"
    argv = ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=exp", f"model.path={tiny_model_dir}",
            "inference.num_servers=1"]

    def failing_job(cfg, sup):
        raise JobFailed("trainer exited with status 1")

    monkeypatch.setattr(launcher.local.signal, "signal", lambda *args: None)  # keep pytest's SIGTERM
    for job, rc in ((lambda cfg, sup: None, 0), (failing_job, 1)):
        monkeypatch.setattr(launcher.local, "run_job", job)
        assert main([*argv, "--overwrite"]) == rc
        assert not lock.exists(), f"exit status {rc} left {lock}"
    (tmp_path / "exp" / "metrics.jsonl").write_text("")  # refused: the run directory holds a run
    assert main(argv) == 2 and "already holds a run" in capsys.readouterr().err
    assert not lock.exists()
    assert main([*argv, "data.task=nosuch"]) == 2 and not lock.exists()  # a check after the lock is taken
    cfg = load_config(None, ["name=exp", f"run_root={tmp_path}"])
    with lock_run(cfg):  # another launcher holds the name: refused, and its lock stays
        assert main(argv) == 2 and "in use by another launcher" in capsys.readouterr().err
        assert lock.exists()
        with pytest.raises(ValueError, match="in use by another launcher"):
            with lock_run(cfg):
                pass
    assert not lock.exists()


def test_a_lock_file_removed_before_it_is_locked_is_opened_again(tmp_path, monkeypatch):
    # Launcher B opens the lock file; before it locks it, launcher A exits (removing the file) and
    # launcher C takes the name with a new file. B must not lock the removed file: it would then
    # share the run with C.
    import contextlib
    import fcntl

    from launcher.local import lock_run

    cfg = load_config(None, ["name=exp", f"run_root={tmp_path}"])
    others = contextlib.ExitStack()
    others.enter_context(lock_run(cfg))  # A
    real_flock, raced = fcntl.flock, []

    def flock(fd, op):
        if not raced:
            raced.append(True)
            others.close()  # A exits
            others.enter_context(lock_run(cfg))  # C
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with others, pytest.raises(ValueError, match="in use by another launcher"):
        with lock_run(cfg):  # B
            pass


def test_child_killed_by_a_signal_is_named(tmp_path):
    import signal

    sup = Supervisor(tmp_path / "logs")
    trainer = sup.start("trainer", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    worker = sup.start("worker0", [PY, "-c", "import time; time.sleep(600)"], expect_exit=True)
    os.kill(worker.proc.pid, signal.SIGKILL)
    with pytest.raises(JobFailed, match="worker0 was killed by SIGKILL"):
        sup.wait_for(trainer, poll_s=0.05)
    sup.stop_all(grace_s=2)


@pytest.mark.parametrize("config", ["quickstart_cpu.yaml", "gsm8k_smollm2.yaml"])
def test_shipped_configs_pass_the_checks_before_start(tmp_path, tiny_model_dir, config):
    # Everything prepare_run checks before a process starts (devices, task, reward function,
    # ports, run directory), on the shipped CPU configs as a user runs them: reward.fn left
    # empty means the task's own reward, not an unknown function.
    from launcher.local import prepare_run

    cfg = load_config(f"configs/{config}", [f"model.path={tiny_model_dir}", f"run_root={tmp_path}",
                                            "inference.num_servers=1"])
    assert cfg.reward.fn == ""
    resolved = prepare_run(cfg, overwrite=False)
    assert (resolved.run_dir / "config.yaml").exists()


@pytest.mark.parametrize("overrides, words", [
    (["algo.kl_coef=0.1"], "algo.kl_coef=0.1"),
    (["trainer.adam_betas=[2, 3]"], "trainer.adam_betas=[2.0, 3.0]"),
    (["trainer.compile=true", "mode=deterministic"], "trainer.compile=true"),
    (["trainer.lr=.inf"], "trainer.lr=inf: must be a finite number"),
    (["reward.correct=.nan"], "reward.correct=nan: must be a finite number"),
])
def test_trainer_settings_it_cannot_run_fail_at_load(overrides, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        load_config("configs/quickstart_cpu.yaml", overrides)


def test_flags_go_anywhere_among_the_overrides_and_a_directory_is_not_a_config(tmp_path, capsys):
    # --overwrite before the overrides used to fail with "unrecognized arguments"; every call
    # below stops at the (deliberately unknown) task, after the arguments were parsed
    from launcher.local import main

    for argv in (["configs/quickstart_cpu.yaml", "--overwrite", f"run_root={tmp_path}", "data.task=nosuch"],
                 ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "--resume", "data.task=nosuch"]):
        assert main(argv) == 2
        assert "data.task='nosuch' is not a registered task" in capsys.readouterr().err
    assert main(["configs", f"run_root={tmp_path}"]) == 2
    assert "configs is a directory; give the path of a YAML config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--overwrite"])
    err = capsys.readouterr().err
    assert "the config is required" in err and "overrides" not in err.splitlines()[-1]


@pytest.mark.parametrize("overrides, error, words", [
    (["inference.backend=sglang"], ValueError, "inference.backend=sglang but SGLang is not installed"),
    (["data.task=gsm8k", "data.train_path=nosuch.jsonl"], FileNotFoundError, "data file 'nosuch.jsonl' not found"),
    (["eval.num_prompts=301"], ValueError, r"eval.num_prompts=301 but the test split of data.task='arith' has 300 "
                                           r"prompts; set eval.num_prompts=300 or fewer"),
    # an empty training file started the job, and its worker died at every start (no prompt fits)
    (["data.task=gsm8k", "data.train_path=/dev/null"], ValueError,
     r"data.train_path=/dev/null holds no prompt of data.task='gsm8k' \(the file is empty\); give a file"),
    # an empty test file was "set eval.num_prompts=0 or fewer", which eval.num_prompts >= 1 forbids
    (["data.task=gsm8k", "data.test_path=/dev/null"], ValueError,
     r"evaluation is on but data.test_path=/dev/null holds no prompt .* give a test file with prompts, or turn "
     r"evaluation off: eval.at_start=false eval.at_end=false eval.every_steps=0"),
    # a host that does not resolve was a raw socket.gaierror, one that is no address of this machine a raw OSError
    (["queue.host=example.invalid"], ValueError,
     r"queue.host='example.invalid' cannot be listened on here \(.+\); set queue.host to an address of this "
     r"machine, e.g. queue.host=127.0.0.1"),
    (["inference.host=10.255.255.1"], ValueError,
     r"inference.host='10.255.255.1' cannot be listened on here \(Cannot assign requested address\); set "
     r"inference.host to an address of this machine"),
    (["trainer.weight_sync_host=10.255.255.1"], ValueError,
     r"trainer.weight_sync_host='10.255.255.1' cannot be listened on here \(Cannot assign requested address\)"),
])
def test_a_launch_refused_before_start_leaves_no_run_directory(tmp_path, tiny_model_dir, monkeypatch,
                                                               overrides, error, words):
    import importlib.util

    from launcher.local import prepare_run

    find_spec = importlib.util.find_spec  # SGLang absent, whether or not this machine has it
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "sglang" else find_spec(name, *args))
    cfg = load_config("configs/quickstart_cpu.yaml", [f"model.path={tiny_model_dir}", f"run_root={tmp_path}",
                                                      "inference.num_servers=1", *overrides])
    with pytest.raises(error, match=words):
        prepare_run(cfg, overwrite=False)
    assert not cfg.run_dir.exists()


def test_a_refused_overwrite_keeps_the_old_run(tmp_path):
    from launcher.local import prepare_run

    cfg = load_config(None, ["name=exp", f"run_root={tmp_path}", "model.path=nosuch", "data.task=arith",
                             "inference.num_servers=1"])
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="model.path 'nosuch' is not a directory"):
        prepare_run(cfg, overwrite=True)
    assert (tmp_path / "exp" / "metrics.jsonl").read_text() == "{}\n"


def test_a_run_root_that_cannot_hold_runs_is_a_launch_error(tmp_path, capsys):
    # A file as run_root was a raw FileExistsError traceback (exit status 1)
    from launcher.local import main

    afile = tmp_path / "notes.txt"
    afile.write_text("")
    for root, why in ((afile, "it is a file, not a directory"), (afile / "runs", f"{afile / 'runs'}: Not a directory")):
        assert main(["configs/quickstart_cpu.yaml", f"run_root={root}"]) == 2
        err = capsys.readouterr().err
        assert f"run_root={root} cannot hold runs ({why}" in err and "set run_root to a directory you can write" in err
    assert afile.read_text() == ""


def test_a_run_directory_that_cannot_hold_the_run_is_a_launch_error(tmp_path, tiny_model_dir, capsys):
    # Each was a raw traceback (exit status 1) when config.yaml was written: PermissionError, FileExistsError
    import subprocess

    from launcher.local import main

    argv = ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=done", f"model.path={tiny_model_dir}"]
    (tmp_path / "done").write_text("notes")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'done'} (run_root={tmp_path}, name=done) is a file, not a directory; " \
           f"choose another name (name=...) or run_root, or remove it" in err
    assert (tmp_path / "done").read_text() == "notes"
    (tmp_path / "done").unlink()
    (tmp_path / "done").mkdir()
    # unwritable even for root: the immutable attribute (chmod does not stop root); else, not root, chmod
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(tmp_path / "done")], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here, and root writes through directory permissions")
    else:
        (tmp_path / "done").chmod(0o500)
    try:
        assert main(argv) == 2
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(tmp_path / "done")], check=True)
        else:
            (tmp_path / "done").chmod(0o700)
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'done'} (run_root={tmp_path}, name=done) cannot be written (" in err
    assert "choose another name (name=...) or run_root, or make it writable" in err
    assert list((tmp_path / "done").iterdir()) == []


def test_an_eval_every_steps_that_never_comes_due_is_a_warning_at_launch(tmp_path, tiny_model_dir, capsys):
    # eval.every_steps > trainer.total_steps was accepted silently; evaluation then runs only at the
    # start and the end (trainer/evaluation.py: version % every_steps == 0 never holds for 0 < version <= total)
    from launcher.local import prepare_run

    base = [f"model.path={tiny_model_dir}", f"run_root={tmp_path}", "inference.num_servers=1", "trainer.total_steps=3"]
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=a", "eval.every_steps=5"]), overwrite=False)
    err = capsys.readouterr().err
    assert ("[launcher] warning: eval.every_steps=5 is more than trainer.total_steps=3, so it never comes due: "
            "evaluation runs at step 0 and at the end (step 3); lower eval.every_steps") in err
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=b", "eval.every_steps=5",
                                                            "eval.at_start=false", "eval.at_end=false"]), overwrite=False)
    assert "evaluation runs never;" in capsys.readouterr().err
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=c", "eval.every_steps=3"]), overwrite=False)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_an_unwritable_run_root_is_a_launch_error(tmp_path, capsys):
    from launcher.local import main

    root = tmp_path / "runs"
    root.mkdir(mode=0o555)
    assert main(["configs/quickstart_cpu.yaml", f"run_root={root}"]) == 2
    err = capsys.readouterr().err
    assert f"run_root={root} cannot hold runs" in err and "Permission denied" in err
    assert list(root.iterdir()) == []


def test_resume_without_a_checkpoint_or_a_run_says_what_to_do_instead(tmp_path, tiny_model_dir, monkeypatch,
                                                                       capsys):
    # The advice was "run without --resume", which then failed: "already holds a run; ... pass --overwrite"
    import launcher.local
    from launcher.local import main

    argv = ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=exp", f"model.path={tiny_model_dir}",
            "inference.num_servers=1"]
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"run_root {tmp_path} holds no run 'exp'" in err and not (tmp_path / "exp").exists()
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "metrics.jsonl").write_text("{}\n")  # an interrupted run, trainer.checkpoint_every: 0
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint with training state" in err
    assert "start the run afresh with --overwrite instead of --resume" in err
    assert "set trainer.checkpoint_every=N" in err
    monkeypatch.setattr(launcher.local.signal, "signal", lambda *args: None)  # keep pytest's SIGTERM
    monkeypatch.setattr(launcher.local, "run_job", lambda cfg, sup: None)
    assert main([*argv, "--overwrite"]) == 0  # the advice works


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


def test_resume_with_no_steps_left_and_a_bad_progress_mode_are_launch_errors(tmp_path, tiny_model_dir,
                                                                             monkeypatch, capsys):
    # Both started every process first: a resume at total_steps <= the checkpoint's step died in the
    # trainer with a misleading MixedVersionError, a bad AREAL_ASYNC_PROGRESS 22 s later in a traceback
    import json

    import launcher.local
    from launcher.local import main

    monkeypatch.setattr(launcher.local.signal, "signal", lambda *args: None)  # keep pytest's SIGTERM
    monkeypatch.setattr(launcher.local, "run_job", lambda cfg, sup: pytest.fail("the job must not start"))
    argv = ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=exp", f"model.path={tiny_model_dir}",
            "trainer.total_steps=3", "inference.num_servers=1"]
    (tmp_path / "exp" / "checkpoint").mkdir(parents=True)
    (tmp_path / "exp" / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 3}))
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is at step 3, and trainer.total_steps=3 leaves nothing to run" in err
    assert "trainer.total_steps=N with N > 3" in err
    monkeypatch.setenv("AREAL_ASYNC_PROGRESS", "Bar")
    assert main([*argv, "name=fresh"]) == 2
    assert "AREAL_ASYNC_PROGRESS='Bar' is not a progress mode" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()


def test_ports_set_to_0_are_chosen_free_distinct_and_consecutive_for_the_servers():
    import socket

    from launcher.ports import PORT_KEYS, choose_ports, port_of

    cfg = load_config(None, ["inference.num_servers=3"])
    assert all(port_of(cfg, k) == 0 for k in PORT_KEYS)  # the defaults: chosen at start
    with socket.socket() as given:
        given.bind(("127.0.0.1", 0))
        queue_port = given.getsockname()[1]
    cfg = load_config(None, ["inference.num_servers=3", f"queue.port={queue_port}"])
    keys = ("inference.base_port", "trainer.master_port", "trainer.weight_sync_port")
    resolved, chosen = choose_ports(cfg, keys)
    assert set(chosen) == set(keys) and resolved.queue.port == queue_port
    base = resolved.inference.base_port
    ports = [base, base + 1, base + 2, resolved.queue.port, resolved.trainer.master_port,
             resolved.trainer.weight_sync_port]
    assert len(set(ports)) == 6 and all(ports), ports
    assert resolved.inference.urls()[2] == f"http://127.0.0.1:{base + 2}"
    from launcher.local import check_ports

    check_ports(resolved)  # every port free, none shared
    check_ports(load_config(None, ["inference.num_servers=2"]))  # 0s are not "both port 0"


def test_resume_chooses_again_the_ports_chosen_last_time(tmp_path):
    import json

    from launcher.ports import keys_to_choose, write_record

    cfg = load_config(None, [f"run_root={tmp_path}", "name=r", "queue.port=31234", "trainer.master_port=31235",
                             "inference.base_port=31236", "trainer.weight_sync_port=31237"])
    cfg.run_dir.mkdir()
    write_record(cfg, ("queue.port", "trainer.master_port"))  # those two were chosen by the stopped job
    record = json.loads((cfg.run_dir / "run.json").read_text())
    assert record["ports"]["queue.port"] == 31234 and record["chosen"] == ["queue.port", "trainer.master_port"]
    assert record["server_urls"] == ["http://127.0.0.1:31236"]
    # the run's own config.yaml given again: its chosen ports are chosen afresh, the given ones kept
    assert keys_to_choose(cfg, resume=True) == ("queue.port", "trainer.master_port")
    assert keys_to_choose(cfg, resume=False) == ()
    moved = load_config(None, [f"run_root={tmp_path}", "name=r", "queue.port=0", "trainer.master_port=40000",
                               "inference.base_port=31236", "trainer.weight_sync_port=31237"])
    assert keys_to_choose(moved, resume=True) == ("queue.port",)


def _bind_child(cfg, sup):
    """A stub job: one process that binds ``queue.port`` (as the queue does) and exits."""
    code = ("import socket, sys\ns = socket.socket()\ns.bind(('127.0.0.1', int(sys.argv[1])))\n"
            "print('bound', sys.argv[1])")
    child = sup.start("queue", [PY, "-c", code, str(cfg.queue.port)], expect_exit=True)
    sup.wait_for(child, poll_s=0.05)


def test_a_chosen_port_taken_before_its_bind_is_chosen_again_once(tmp_path, monkeypatch, capsys):
    import json
    import socket

    import launcher.local
    from areal_async.config import dump_config
    from launcher.local import launch
    from launcher.ports import write_record

    monkeypatch.setattr(launcher.local, "run_job", _bind_child)
    with socket.socket() as thief:  # took the chosen port between its choice and the queue's bind
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = thief.getsockname()[1]
        cfg = load_config(None, [f"run_root={tmp_path}", "name=race", f"queue.port={taken}"])
        cfg.run_dir.mkdir()
        dump_config(cfg, cfg.run_dir / "config.yaml")
        write_record(cfg, ("queue.port",))
        assert launch(cfg) == 0
        out = capsys.readouterr()
        assert "a chosen port was taken before its process could bind it" in out.err
        record = json.loads((cfg.run_dir / "run.json").read_text())
        new = record["ports"]["queue.port"]
        assert new != taken and load_config(cfg.run_dir / "config.yaml").queue.port == new
        log = (cfg.run_dir / "logs" / "queue.log").read_text()
        assert "Address already in use" in log and "===== new ports after a port was taken" in log
        assert log.rstrip().endswith(f"bound {new}")
        # a port that was given, not chosen: no second attempt, the job fails naming the cause
        cfg = load_config(None, [f"run_root={tmp_path}", "name=given", f"queue.port={taken}"])
        cfg.run_dir.mkdir()
        write_record(cfg, ())
        assert launch(cfg) == 1
        err = capsys.readouterr().err
        assert "Address already in use" in err and "new ports" not in err


def test_two_jobs_started_at_once_need_no_port_overrides(tmp_path, tiny_model_dir):
    # Every port defaults to 0: two jobs started together on one machine pick distinct free ones
    # (before, the second needed four overrides and failed on the first port it shared)
    import json
    import pathlib
    import subprocess

    from tests.support.jobs import TINY_JOB_CONFIG, tiny_job_overrides

    procs = {name: subprocess.Popen([PY, "-m", "launcher.local", TINY_JOB_CONFIG, f"name={name}",
                                     f"run_root={tmp_path}", *tiny_job_overrides(tiny_model_dir)],
                                    cwd=pathlib.Path(__file__).parents[1], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name in ("a", "b")}
    outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    ports = {}
    for name, p in procs.items():
        assert p.returncode == 0, outs[name][-3000:]
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "train/loss" in r] == [0, 1]
        record = json.loads((tmp_path / name / "run.json").read_text())
        assert sorted(record["chosen"]) == sorted(record["ports"]) and all(record["ports"].values())
        assert load_config(tmp_path / name / "config.yaml").queue.port == record["ports"]["queue.port"]
        assert f"queue.port={record['ports']['queue.port']} (chosen)" in outs[name]  # printed
        ports[name] = set(record["ports"].values())
    assert not ports["a"] & ports["b"], ports


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


def test_a_ray_job_with_gpu_bundles_is_prepared_on_a_launcher_node_without_a_gpu(tmp_path, tiny_model_dir):
    # launcher.ray's two-node recipe starts from a head that may have no GPU: the devices are the
    # bundles' (cluster.gpus_per_*), so "cuda" is not refused here and auto dtypes resolve for CUDA.
    import torch

    from launcher.local import prepare_run

    over = [f"model.path={tiny_model_dir}", f"run_root={tmp_path}", "inference.device=cuda", "trainer.device=cuda",
            "trainer.nproc=2", "inference.num_servers=2", "cluster.gpus_per_server=1",
            "cluster.gpus_per_trainer_rank=1", "model.dtype=auto", "trainer.dtype=auto"]
    cfg = load_config("configs/quickstart_cpu.yaml", over)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device here"):
            prepare_run(cfg, overwrite=False)
    ready = prepare_run(cfg, overwrite=True, own_gpus=True)
    assert (ready.model.dtype, ready.trainer.dtype) == ("bfloat16", "bfloat16")
