"""What the launcher checks before anything starts: command lines, ports (chosen, in use, shared),
the run lock, run directories, resume, and the shipped configs."""

import os
import re
import sys

import pytest

from areal_async.config import load_config
from areal_async.determinism import deterministic_env
from launcher.servers import SERVER_ARGV

PY = sys.executable


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


def test_a_resume_with_another_batch_size_or_n_samples_than_its_checkpoint_is_a_launch_error(tmp_path, tiny_model_dir,
                                                                                            monkeypatch, capsys):
    # It started every process, then the replay queue died on the saved groups ("restored groups
    # [12, 13] must be exactly [24, 25]"), after config.yaml had been overwritten with the new size
    import json

    import msgspec

    import launcher.local
    from launcher.local import main
    from tests.support.batches import traj

    monkeypatch.setattr(launcher.local.signal, "signal", lambda *args: None)  # keep pytest's SIGTERM
    monkeypatch.setattr(launcher.local, "run_job", lambda cfg, sup: None)
    ckpt = tmp_path / "exp" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 6}))
    (ckpt / "buffer.msgpack").write_bytes(msgspec.msgpack.encode([traj(12), traj(13)]))  # queue.batch_size=2
    argv = ["configs/quickstart_cpu.yaml", f"run_root={tmp_path}", "name=exp", f"model.path={tiny_model_dir}",
            "trainer.total_steps=8", "eval.every_steps=0", "inference.num_servers=1", "--resume"]
    assert main([*argv, "queue.batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "groups 12-13" in err and "queue.batch_size=2" in err and "queue.batch_size=4" in err
    assert not (tmp_path / "exp" / "config.yaml").exists()
    # the same for the samples of a group: the trainer stopped at its first batch with a ContractViolation
    assert main([*argv, "queue.batch_size=2", "rollout.n_samples=4"]) == 2
    err = capsys.readouterr().err
    assert "rollout.n_samples=2" in err and "rollout.n_samples=4" in err
    assert main([*argv, "queue.batch_size=2", "rollout.n_samples=2"]) == 0


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
    # found by the trainer at its first step, after the servers had started
    (["algo.ppo_minibatches=4", "queue.batch_size=2"], "algo.ppo_minibatches=4 is more than queue.batch_size=2"),
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
    (["trainer.lora.rank=4", "trainer.lora.target_modules=[qproj]"], ValueError,
     r"trainer.lora.target_modules=\['qproj'\]: \['qproj'\] is no linear layer of the decoder blocks"),
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


def test_lora_settings_without_a_rank_are_a_warning_at_launch(tmp_path, tiny_model_dir, capsys):
    # trainer.lora.alpha=16 with rank 0 ran full fine-tuning without a word
    from launcher.local import prepare_run

    base = [f"model.path={tiny_model_dir}", f"run_root={tmp_path}", "inference.num_servers=1", "trainer.lr=1e-5"]
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=a", "trainer.lora.alpha=16"]), overwrite=False)
    assert ("[launcher] warning: trainer.lora.alpha=16.0 but trainer.lora.rank=0: LoRA is off and the job fine-tunes "
            "every weight at trainer.lr=1e-05; set trainer.lora.rank=N") in capsys.readouterr().err
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=b"]), overwrite=False)
    assert "warning" not in capsys.readouterr().err


def test_lora_at_a_full_fine_tuning_learning_rate_is_a_warning_at_launch(tmp_path, tiny_model_dir, capsys):
    # trainer.lora.rank=8 at the quickstart's trainer.lr=1e-5 started without a word; docs/lora.md
    # measured LoRA to need 10-30x full fine-tuning's rate (1e-4 at r = 32, 3e-4 at r = 8)
    from launcher.local import prepare_run

    base = [f"model.path={tiny_model_dir}", f"run_root={tmp_path}", "inference.num_servers=1", "trainer.lora.rank=8"]
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=a", "trainer.lr=1e-5"]), overwrite=False)
    err = capsys.readouterr().err
    assert ("[launcher] warning: trainer.lora.rank=8 with trainer.lr=1e-05, below 5e-05: docs/lora.md measured "
            "LoRA to need 10-30x full fine-tuning's learning rate") in err, err
    assert "try trainer.lr=3e-4" in err and "ValueError" not in err
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base, "name=b", "trainer.lr=1e-4"]), overwrite=False)
    assert "warning" not in capsys.readouterr().err
    prepare_run(load_config("configs/quickstart_cpu.yaml", [*base[:3], "name=c", "trainer.lr=1e-5"]), overwrite=False)
    assert "warning" not in capsys.readouterr().err  # full fine-tuning at its own rate


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
