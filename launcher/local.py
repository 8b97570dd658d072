"""Run a whole training job on one machine: servers, queue, workers and trainer as subprocesses.

    python -m launcher.local configs/quickstart_cpu.yaml [section.key=value ...] [--overwrite | --resume]

``main`` holds the run lock while ``prepare_run`` checks what fails cheaply (a refused launch creates
no run directory, exit 2), resolves the model and writes ``RUN_DIR/config.yaml`` and ``run.json``;
``launch`` runs ``run_job``: the servers, then the queue, each waited for until it answers, then the
trainer (``launcher.torchrun``) and the workers, under one ``launcher.supervisor.Supervisor``. Exit
0 when the trainer exits 0, 1 when a process fails beyond its restarts (all stopped), 130 on Ctrl-C
or SIGTERM. Every child gets the launch's token and listens on its configured host (loopback by
default), and runs on the CPUs, threads and GPUs ``launcher.placement`` gives it (by default: not
pinned, the CPU count divided among servers and trainer ranks). The rest: docs/running.md (checks,
start-up, placement, ``--resume``), docs/faults.md (restarts, what stops the job),
docs/configuration.md (ports, security).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import pathlib
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Callable, Iterator

import msgspec

from areal_async import auth
from areal_async.config import Config, dump_config, load_config
from areal_async.cpu_share import PATH_ENV, create_ledger
from areal_async.determinism import deterministic_env
from areal_async.devices import cuda_available, port_in_use
from areal_async.file_lock import file_lock
from areal_async.progress import ENV as PROGRESS_ENV
from launcher.placement import LEDGER_NAME, JobPlacement, place_job
from launcher.ports import choose_ports, describe, is_bind_failure, keys_to_choose, read_record, write_record
from launcher.resolve import check_devices, resolve_dtypes, resolve_tree_attention
from launcher.servers import (PY, SERVER_ARGV, ServerProbe, _server_argv, check_backend, http_status,
                              remove_stale_weights, restart_argv, server_failed, sglang_lora_start)
from launcher.supervisor import HealthCheck, JobFailed, Restart, Supervisor


def _job_env(token: str) -> dict[str, str]:
    """What every child of a job gets: the job's token and, each unless set, gloo's and NCCL's
    sockets on the loopback interface (otherwise gloo listens on the address of this machine's host
    name, NCCL's bootstrap and proxy on its first non-loopback interface)."""
    env = {auth.ENV: token}
    if "lo" in {name for _, name in socket.if_nameindex()}:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in os.environ:
                env[var] = "lo"
    return env


def _wait_until(ready, what: str, sup: Supervisor, timeout_s: float) -> None:
    """Poll ``ready()`` until true, failing fast if any child dies meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        sup.check()
        if time.monotonic() > deadline:
            raise JobFailed(f"{what} did not come up within {timeout_s:.0f} s; "
                            f"see the logs in {sup.log_dir}")
        time.sleep(0.5)


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


@contextlib.contextmanager
def lock_run(cfg: Config) -> Iterator[None]:
    """Hold ``RUN_ROOT/.<name>.lock`` while the block runs, so two jobs can never share (or
    overwrite) one run directory, then remove it (``file_lock``). Raises ``ValueError`` if another
    launcher holds it, or if ``run_root`` is not a directory this user can write."""
    root = pathlib.Path(cfg.run_root)
    with contextlib.ExitStack() as held:
        try:
            root.mkdir(parents=True, exist_ok=True)
            held.enter_context(file_lock(root / f".{cfg.name}.lock", wait=False))
        except BlockingIOError:
            raise ValueError(f"run '{cfg.name}' in {root} is in use by another launcher; "
                             f"choose another name (name=...)") from None
        except OSError as exc:
            why = ("it is a file, not a directory" if root.exists() and not root.is_dir()
                   else f"{exc.filename}: {exc.strerror}")
            raise ValueError(f"run_root={cfg.run_root} cannot hold runs ({why}); set run_root to a "
                             f"directory you can write, e.g. run_root=runs") from None
        yield


def check_ports(cfg: Config) -> None:
    """Raise ``ValueError`` naming the config key if a port the job needs is reused (checked
    first: a config error, whatever else runs on the machine) or taken. Port 0 (chosen at start,
    ``launcher/ports.py``) is not checked."""
    wanted = {f"inference.base_port+{i}" if i else "inference.base_port": (cfg.inference.host, p)
              for i, p in enumerate(range(cfg.inference.base_port,
                                          cfg.inference.base_port + cfg.inference.num_servers))}
    wanted |= {"queue.port": (cfg.queue.host, cfg.queue.port),
               "trainer.master_port": ("127.0.0.1", cfg.trainer.master_port),
               "trainer.weight_sync_port": (cfg.trainer.weight_sync_host, cfg.trainer.weight_sync_port)}
    wanted = {key: where for key, where in wanted.items() if where[1]}
    seen: dict[int, str] = {}
    for key, (_, port) in wanted.items():
        if port in seen:
            raise ValueError(f"{key} and {seen[port]} are both port {port}; give them distinct ports")
        seen[port] = key
    for key, (host, port) in wanted.items():
        if port_in_use(host, port):
            raise ValueError(f"port {port} ({key}) is already in use on {host}, perhaps by "
                             f"another job; set {key.split('+')[0]}=<a free port>")


def check_hosts(cfg: Config) -> None:
    """Raise ``ValueError`` naming the key if a host the job listens on (``inference.host``,
    ``queue.host``, ``trainer.weight_sync_host`` with the distributed weight sync; the trainer's
    rendezvous is on ``127.0.0.1``) does not resolve or is no address of this machine: binding it
    (port 0) fails, with the OS's reason."""
    hosts = [("inference.host", cfg.inference.host), ("queue.host", cfg.queue.host)]
    if cfg.trainer.weight_sync == "distributed":
        hosts.append(("trainer.weight_sync_host", cfg.trainer.weight_sync_host))
    for key, host in hosts:
        why = port_in_use(host, 0)  # a name that does not resolve is a socket.gaierror, an OSError too
        if why:
            raise ValueError(f"{key}={host!r} cannot be listened on here ({why}); set {key} to an address of "
                             f"this machine, e.g. {key}=127.0.0.1")


def sparse_eval_warning(cfg: Config) -> str:
    """What evaluation runs when ``eval.every_steps`` exceeds ``trainer.total_steps`` (it never
    comes due): only ``eval.at_start``'s and ``eval.at_end``'s, if on (``trainer/evaluation.py``)."""
    e, total = cfg.eval, cfg.trainer.total_steps
    runs = [what for on, what in ((e.at_start, "at step 0"), (e.at_end, f"at the end (step {total})")) if on]
    return (f"eval.every_steps={e.every_steps} is more than trainer.total_steps={total}, so it never comes due: "
            f"evaluation runs {' and '.join(runs) if runs else 'never'}; lower eval.every_steps to evaluate "
            f"during training")


def lora_off_warning(cfg: Config) -> str:
    """What a job does with ``trainer.lora`` settings given but ``trainer.lora.rank`` 0 (LoRA off):
    ``""`` when every setting is its default."""
    lora = cfg.trainer.lora
    given = [f"trainer.lora.{k}={v}" for k, v, default in (("alpha", lora.alpha, 0.0), ("dropout", lora.dropout, 0.0),
                                                          ("target_modules", lora.target_modules, "all-linear"))
             if v != default]
    if lora.rank or not given:
        return ""
    return (f"{', '.join(given)} but trainer.lora.rank=0: LoRA is off and the job fine-tunes every weight at "
            f"trainer.lr={cfg.trainer.lr:g}; set trainer.lora.rank=N (e.g. 8) to train adapters")


LORA_MIN_LR = 5e-5  # below it LoRA learned less than full fine-tuning in docs/lora.md#learning-parity


def lora_lr_warning(cfg: Config) -> str:
    """What a LoRA job (``trainer.lora.rank > 0``) at ``trainer.lr`` below ``LORA_MIN_LR`` misses
    (docs/lora.md's measured rates) and the override to try; ``""`` otherwise."""
    rank, lr = cfg.trainer.lora.rank, cfg.trainer.lr
    if not rank or lr >= LORA_MIN_LR:
        return ""
    return (f"trainer.lora.rank={rank} with trainer.lr={lr:g}, below {LORA_MIN_LR:g}: docs/lora.md measured LoRA "
            f"to need 10-30x full fine-tuning's learning rate (SmolLM2-135M, 100 steps: full fine-tuning at 1e-5 "
            f"was matched by r = 32 at 1e-4 and r = 8 at 3e-4; r = 32 at 3e-5 learned less); try "
            f"trainer.lr={'1e-4' if rank >= 32 else '3e-4'}")


def check_run_dir(cfg: Config) -> None:
    """Raise ``ValueError`` if the run directory exists but cannot hold the run: it is a file, or
    a file cannot be created in it (the ``run_root`` itself is checked by ``lock_run``)."""
    run_dir = cfg.run_dir
    if not run_dir.exists() and not run_dir.is_symlink():
        return
    fix = "choose another name (name=...) or run_root"
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} (run_root={cfg.run_root}, name={cfg.name}) is a file, not "
                         f"a directory; {fix}, or remove it")
    try:
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        raise ValueError(f"run directory {run_dir} (run_root={cfg.run_root}, name={cfg.name}) cannot be "
                         f"written ({exc.strerror}); {fix}, or make it writable") from None


def prepare_run(cfg: Config, overwrite: bool, resume: bool = False, own_gpus: bool = False) -> Config:
    """Check what can be checked before any process starts, then create the run directory and
    write the resolved config, model path resolved (``resume``: keep the directory and set
    ``trainer.resume``). A check that fails leaves the run directory as it was, or absent.
    ``own_gpus``: every server and trainer rank gets its own GPUs from Ray (``check_devices``)."""
    from areal_async.model.source import resolve_model_path

    from areal_async.data import TASKS, load_task
    from areal_async.reward.pool import resolve_reward_fn

    from areal_async.progress import progress_mode

    check_backend(cfg.inference)
    # own_gpus: the processes run on the GPU nodes Ray gives them, which need not include this one
    cuda = own_gpus or cuda_available()
    check_devices(cfg, cuda, own_gpus)
    progress_mode()  # a bad AREAL_ASYNC_PROGRESS is a ValueError naming the choices, before any process starts
    if cfg.data.task not in TASKS:
        raise ValueError(f"data.task={cfg.data.task!r} is not a registered task; choose one of {sorted(TASKS)}")
    # what the workers and the trainer read: a missing, bad or empty file fails here
    if len(load_task(cfg.data, "train")) == 0:
        raise ValueError(f"data.train_path={cfg.data.train_path} holds no prompt of data.task={cfg.data.task!r} "
                         f"(the file is empty); give a file with prompts")
    test = load_task(cfg.data, "test")
    e = cfg.eval
    evaluates = e.at_start or e.at_end or e.every_steps
    if evaluates and len(test) == 0:
        raise ValueError(f"evaluation is on but data.test_path={cfg.data.test_path} holds no prompt of data.task="
                         f"{cfg.data.task!r} (the file is empty); give a test file with prompts, or turn "
                         f"evaluation off: eval.at_start=false eval.at_end=false eval.every_steps=0")
    if evaluates and e.num_prompts > len(test):
        raise ValueError(f"eval.num_prompts={e.num_prompts} but the test split of data.task={cfg.data.task!r} has "
                         f"{len(test)} prompts; set eval.num_prompts={len(test)} or fewer")
    if e.every_steps > cfg.trainer.total_steps:
        print(f"[launcher] warning: {sparse_eval_warning(cfg)}", file=sys.stderr, flush=True)
    for warning in (lora_off_warning(cfg), lora_lr_warning(cfg)):
        if warning:
            print(f"[launcher] warning: {warning}", file=sys.stderr, flush=True)
    if cfg.reward.fn:  # empty: the task's own reward function
        resolve_reward_fn(cfg.reward.fn)  # ValueError naming the fix, before any process starts
    if cfg.rollout.workflow:
        from areal_async.rollout.workflows import load_workflow

        load_workflow(cfg.rollout.workflow, cfg.rollout.temperature, cfg.rollout.top_p)  # the same, for the episode
    placed = job_placement(cfg)  # a ValueError naming the key and the fix
    for warning in placed.warnings:
        print(f"[launcher] warning: {warning}", file=sys.stderr, flush=True)
    if placed.pins:
        print(f"[launcher] placement: {placed.describe()}", flush=True)
    cfg = resolve_dtypes(cfg, cuda)
    cfg = resolve_tree_attention(cfg, cuda)  # a ValueError naming the fix
    chosen = keys_to_choose(cfg, resume)  # resume: the stopped job's chosen ports may be taken by now
    check_hosts(cfg)  # before choose_ports, which binds them
    cfg, _ = choose_ports(cfg, chosen)
    check_ports(cfg)
    check_run_dir(cfg)
    run_dir = cfg.run_dir
    replace = not resume and (run_dir / "metrics.jsonl").exists()
    if resume:
        from areal_async.trainer.resume import check_restored_groups, read_step, recover_checkpoint

        if not run_dir.is_dir():
            raise ValueError(f"--resume: run_root {cfg.run_root} holds no run '{cfg.name}' ({run_dir} does not "
                             f"exist); give the name of an existing run (name=...), or start this one "
                             f"without --resume")
        recover_checkpoint(run_dir / "checkpoint")  # a publish interrupted between its two renames
        done = read_step(run_dir / "checkpoint")  # FileNotFoundError naming the fix when there is none
        from areal_async.trainer.lora import check_checkpoint_kind

        check_checkpoint_kind(run_dir / "checkpoint", cfg.trainer.lora.rank)  # adapters only, or full weights
        # else the queue or the trainer fails on them once every process has started
        check_restored_groups(run_dir / "checkpoint", cfg.queue.batch_size, cfg.rollout.n_samples)
        if done >= cfg.trainer.total_steps:
            raise ValueError(f"--resume: the checkpoint of run '{cfg.name}' is at step {done}, and "
                             f"trainer.total_steps={cfg.trainer.total_steps} leaves nothing to run; give "
                             f"trainer.total_steps=N with N > {done} to train further")
        cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, resume=True))
    elif replace and not overwrite:
        raise ValueError(f"{run_dir} already holds a run; choose another name (name=...), "
                         f"delete it, or pass --overwrite")
    model_path = str(resolve_model_path(cfg.model))  # a bad path removes and creates nothing
    if cfg.trainer.lora.rank:  # target modules, and a resume's settings, checked before anything starts
        from areal_async.trainer.lora import check_lora_settings

        if warning := check_lora_settings(model_path, cfg.trainer.lora, run_dir / "checkpoint" if resume else None,
                                          cfg.trainer.dtype):
            print(f"[launcher] warning: {warning}", file=sys.stderr, flush=True)
    if replace:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=model_path))
    dump_config(cfg, run_dir / "config.yaml")
    write_record(cfg, chosen)
    return cfg


def release_worker(cfg: Config, token: str | None, worker_id: int, why: str = "") -> str:
    """Before worker ``worker_id`` is started again: the queue takes back the groups it held
    (they are leased again first, same ids); returns a note for the launcher's line. ``token``:
    the job's (the queue refuses a connection without it).

    Raises:
        ConnectionError: the queue is not reachable within 10 s.
        TimeoutError: it did not answer within 30 s.
    """
    from areal_async.queue.client import QueueClient

    async def release() -> list[int]:
        async with await QueueClient.connect(cfg.queue.host, cfg.queue.port, timeout_s=10.0, token=token) as q:
            return await asyncio.wait_for(q.release(worker_id, restart=True), 30.0)

    ids = asyncio.run(release())
    # the queue usually took them back already, when the dead worker's connection closed
    return f"groups {ids} go back to the queue" if ids else "the queue took back its groups (logs/queue.log)"


def job_placement(cfg: Config) -> JobPlacement:
    """Each process's CPUs, threads and GPUs on this machine (``launcher/placement.py``).

    Raises:
        ValueError: see ``place_job``.
    """
    return place_job(cfg, frozenset(os.sched_getaffinity(0)), os.cpu_count() or 1, os.environ)


def run_job(cfg: Config, sup: Supervisor) -> None:
    """Start every process of the job and block until the trainer finishes."""
    config_path = str(cfg.run_dir / "config.yaml")
    inf = cfg.inference
    placed = job_placement(cfg)
    make_argv = SERVER_ARGV[inf.backend]
    token = sup.env.get(auth.ENV)  # the job's (launch); the children read it from their environment
    model, version, queue_args, adapter = cfg.model, 0, [], None
    if cfg.trainer.resume:
        from areal_async.trainer.resume import read_step

        ckpt = cfg.run_dir / "checkpoint"
        version = read_step(ckpt)
        if cfg.trainer.lora.rank:  # an adapter-only checkpoint: the servers merge it into the base at start
            adapter = ckpt.resolve()
        else:
            model = msgspec.structs.replace(cfg.model, path=str(ckpt.resolve()))
        queue_args = ["--start-version", str(version), "--restore", str(ckpt / "buffer.msgpack")]
        print(f"[launcher] resuming at step {version} from {ckpt}", flush=True)
    if PATH_ENV in placed.trainer.env:  # cpu_threads: adaptive; every server and trainer rank idle until it computes
        create_ledger(cfg.run_dir / LEDGER_NAME, inf.num_servers + cfg.trainer.nproc)
    disk = cfg.trainer.weight_sync == "disk"
    if disk:
        remove_stale_weights(cfg.run_dir)
    lora_flags = []
    if cfg.trainer.lora.rank and inf.backend == "sglang":  # every /generate names the adapter: loaded from the start
        adapter, lora_flags = sglang_lora_start(cfg, adapter)
    for i, url in enumerate(inf.urls()):
        argv = functools.partial(_server_argv, make_argv, inf, inf.base_port + i, cfg.mode, placed.servers[i].threads,
                                 cfg.debug, token, lora_flags=lora_flags)
        # disk sync: from the newest weights or adapter it wrote; distributed: as first started, the next update's
        # group rebuild sends it the current ones (docs/faults.md)
        newest = functools.partial(restart_argv, cfg.run_dir, i, argv, model, version, adapter,
                                   lora=bool(cfg.trainer.lora.rank))
        restart = Restart(inf.max_server_restarts, functools.partial(server_failed, cfg, token, sup, i),
                          argv=newest if disk else None)
        health = HealthCheck(ServerProbe(url, inf.max_pause_s), inf.health_check_interval_s, inf.startup_timeout_s)
        sup.start(f"server{i}", argv(model, version, adapter),
                  env={**deterministic_env(cfg.mode), **placed.servers[i].env}, restart=restart, health=health,
                  cpus=placed.servers[i].cpus)
    for url in inf.urls():
        _wait_until(lambda: http_status(url + "/health", 2.0) == 200, f"inference server {url}", sup,
                    inf.startup_timeout_s)
    print(f"[launcher] {inf.num_servers} {inf.backend} server(s) healthy", flush=True)

    sup.start("queue", [PY, "-m", "areal_async.queue.server", "--config", config_path, *queue_args],
              env=dict(placed.queue.env), cpus=placed.queue.cpus)
    _wait_until(lambda: _port_open(cfg.queue.host, cfg.queue.port), "replay queue", sup, 60)

    trainer = sup.start(
        "trainer",
        [PY, "-m", "launcher.torchrun", "--nproc-per-node", str(cfg.trainer.nproc),
         "--master-port", str(cfg.trainer.master_port),
         # its agent's directories (a rank's error.json): the run's, not a /tmp/torchelastic_* left per job
         "--log-dir", str(cfg.run_dir / "logs" / "torchrun"), "-m", "areal_async.trainer.main",
         "--config", config_path],
        env={**placed.trainer.env,
             # its output reaches this terminal through a pipe: tell it whether bars can be drawn
             PROGRESS_ENV: os.environ.get(PROGRESS_ENV) or ("bar" if sys.stdout.isatty() else "lines"),
             **deterministic_env(cfg.mode)},
        echo=True, expect_exit=True, stop_leader_first=True,  # torchrun stops its ranks itself
        cpus=placed.trainer.cpus,
    )
    for w in range(cfg.rollout.num_workers):
        restart = Restart(cfg.rollout.max_worker_restarts, functools.partial(release_worker, cfg, token, w))
        sup.start(f"worker{w}", [PY, "-m", "areal_async.rollout.worker", "--config", config_path,
                                 "--worker-id", str(w)], env=dict(placed.workers.env), expect_exit=True,
                  restart=restart, cpus=placed.workers.cpus)
    print(f"[launcher] trainer ({cfg.trainer.nproc} rank(s)) and {cfg.rollout.num_workers} "
          f"worker(s) started; logs in {sup.log_dir}", flush=True)
    sup.wait_for(trainer)


def launch(cfg: Config, supervisor: Callable[..., Supervisor] = Supervisor) -> int:
    """Run the prepared job under a ``Supervisor`` (``supervisor``: what makes it, called as
    ``Supervisor`` is; ``launcher.ray`` gives one that places each process in a Ray actor); the
    launcher's exit status."""
    print(f"[launcher] run '{cfg.name}' in {cfg.run_dir} (mode {cfg.mode}, "
          f"η = {cfg.queue.max_staleness}, model {cfg.model.path})", flush=True)
    header = None
    if cfg.trainer.resume:  # the logs of the stopped job stay, above this line
        from areal_async.trainer.resume import read_step

        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        header = f"===== --resume at step {read_step(cfg.run_dir / 'checkpoint')}, {stamp} ====="
    chosen = tuple(read_record(cfg.run_dir).get("chosen", ()))
    # the token lives in the children's environment only: the one given in AREAL_ASYNC_TOKEN (to reach
    # the job's servers and queue from outside it), else a new one
    job_env = _job_env(auth.job_token() or auth.new_token())
    print(f"[launcher] ports: {describe(cfg, chosen)}", flush=True)
    for attempt in (1, 2):
        sup = supervisor(cfg.run_dir / "logs", env=job_env, log_header=header)
        rows = _metrics_size(cfg)
        try:
            run_job(cfg, sup)
            break
        except JobFailed as exc:
            # a port chosen here was taken before its process bound it: once, choose anew; not
            # after the job logged anything (then it was no start-up race)
            if attempt == 1 and chosen and is_bind_failure(str(exc)) and _metrics_size(cfg) == rows:
                sup.stop_all()
                cfg = _new_ports(cfg, chosen)
                header = f"===== new ports after a port was taken, {time.strftime('%Y-%m-%d %H:%M:%S %Z')} ====="
                print(f"[launcher] a chosen port was taken before its process could bind it ({exc}); "
                      f"starting again on new ports: {describe(cfg, chosen)}", file=sys.stderr, flush=True)
                continue
            print(f"[launcher] job failed: {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            return _interrupted()  # printed before the children are stopped, which takes a while
        finally:
            sup.stop_all()
    print(f"[launcher] done: {cfg.run_dir}", flush=True)
    return 0


def _metrics_size(cfg: Config) -> int:
    try:
        return (cfg.run_dir / "metrics.jsonl").stat().st_size
    except OSError:
        return -1


def _new_ports(cfg: Config, chosen: tuple[str, ...]) -> Config:
    """``cfg`` with the ``chosen`` port keys picked again, written to ``config.yaml`` and ``run.json``."""
    cfg, _ = choose_ports(cfg, chosen)
    dump_config(cfg, cfg.run_dir / "config.yaml")
    write_record(cfg, chosen)
    return cfg


def _interrupted() -> int:
    print("[launcher] interrupted; stopping every process", file=sys.stderr, flush=True)
    return 130


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT raise ``KeyboardInterrupt`` in the main thread, so
    the launcher unwinds wherever it is (``finally`` blocks remove the run lock and a half-converted
    model). SIGINT too when it was inherited ignored, as a job started with ``&`` from a script
    inherits it. The previous handlers are put back afterwards. Only the first signal raises: a
    second one (``timeout`` sends SIGTERM to the launcher and again to its process group; an
    impatient Ctrl-C) would break off the stop it started, so it is only acknowledged; the stop is
    bounded anyway (``Supervisor.stop_all``: a grace period, then SIGKILL)."""
    raised = False

    def interrupt(signum, frame):
        nonlocal raised
        if raised:
            print(f"[launcher] {signal.Signals(signum).name} again: still stopping every process",
                  file=sys.stderr, flush=True)
            return
        raised = True
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.local", description=__doc__,
                                     usage="%(prog)s [-h] [--overwrite | --resume] config [overrides ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # optional to argparse, checked below: a missing required positional would make argparse call
    # the optional overrides "required" too
    parser.add_argument("config", nargs="?", help="experiment YAML, e.g. configs/quickstart_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. queue.max_staleness=2")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    start.add_argument("--resume", action="store_true", help="continue RUN_DIR from its checkpoint")
    args = parser.parse_intermixed_args(argv)  # flags before, between or after the overrides
    if args.config is None:
        parser.error("the config is required: an experiment YAML, e.g. configs/quickstart_cpu.yaml")
    with interrupt_on_signals(), contextlib.ExitStack() as held:  # held: the run lock, removed however it exits
        try:
            try:
                cfg = load_config(args.config, args.overrides)
                held.enter_context(lock_run(cfg))
                cfg = prepare_run(cfg, args.overwrite, args.resume)  # may convert the model: minutes
            except (ValueError, FileNotFoundError) as exc:
                print(f"[launcher] error: {exc}", file=sys.stderr)
                return 2
            return launch(cfg)
        except KeyboardInterrupt:  # during start-up; launch() handles its own
            return _interrupted()


if __name__ == "__main__":
    sys.exit(main())
