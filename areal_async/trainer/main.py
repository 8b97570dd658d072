"""The trainer process: ``torchrun --nproc-per-node N -m areal_async.trainer.main --config RUN_DIR/config.yaml``.

Every rank holds a shard (FSDP2) or replica (DDP) of the policy; rank 0 alone talks to the
replay queue, the inference servers, the metrics logger and the evaluator, and hands each batch
to the other ranks over the default group. Per step k: take batch k → one decoupled-PPO step →
[deterministic: wait until every group of version ≤ k has finished] → [wait for a running
evaluation] → make version k+1 live on the servers → announce it to the queue → log (the queue
checks its accounting first; a broken one raises ``AccountingError``) → [every
``eval.every_steps``: start evaluating version k+1 in the background, overlapping step k+1's wait
for data and its training] → checkpoint (every ``trainer.checkpoint_every``
steps and at the end; ``trainer.resume`` restarts from it, see ``resume.py``). The run directory
is the directory of the config file.

Deterministic mode additionally: every rank checks each batch against the id/seed/version
contract (``contract.check_batch``, a violation raises), the model's linears compute in fixed row
tiles (``batch_invariant``), ``torch.use_deterministic_algorithms(True)``, and on CUDA
``CUBLAS_WORKSPACE_CONFIG`` plus ``NCCL_ALGO=Ring`` / ``NCCL_PROTO=Simple`` (fixed all-reduce
order) unless already set. ``logging.dump_trajectories`` makes rank 0 append every batch to
``RUN_DIR/trajectories.jsonl``; ``debug.jitter_ms`` sleeps a seeded random delay before taking a
batch and before announcing a version. Any exception ends the process with its traceback and a
non-zero status (torchrun then stops the other ranks, the launcher the job).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import pathlib
import signal
import sys
import time
import traceback

import msgspec
import torch
import torch.distributed as dist

from areal_async import auth
from areal_async.atomic_dir import new_staging_dir, staging_dir
from areal_async.config import Config, load_config, to_dict
from areal_async.jitter import Jitter
from areal_async.progress import Progress, progress_mode
from areal_async.trainer.contract import check_batch, dump_batch
from areal_async.queue.staleness import group_id_limit
from areal_async.trainer.checkpoint import save_hf_checkpoint
from areal_async.trainer.parallel import build_policy, full_state_dict, init_distributed
from areal_async.trainer.report import Timer, batch_metrics, perf_metrics, queue_metrics
from areal_async.trainer.resume import (drop_superseded_rows, has_eval_row, load_training_state,
                                        publish_checkpoint, read_elapsed, save_training_state)
from areal_async.trainer.schedule import make_scheduler
from areal_async.trainer.step import train_step
from areal_async.trainer.weight_sync import DiskWeightSender, DistributedWeightSender, WeightSender
from areal_async.types import Trajectory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Services:
    """Rank 0's connections: queue, inference client, metrics, evaluation (``None`` elsewhere)."""

    def __init__(self, cfg: Config, run_dir: pathlib.Path, stack: contextlib.AsyncExitStack):
        self.cfg, self.run_dir, self.stack = cfg, run_dir, stack
        self._evaluation: asyncio.Task | None = None  # of start_evaluation

    async def start(self, resumed_at: int | None = None) -> "Services":
        """Connect everything; ``resumed_at``: the checkpoint's step of a resumed job (``None``
        for a fresh run), which starts a new wandb run (``metrics.MetricsLogger``)."""
        from areal_async.data import load_task
        from areal_async.data.prompts import PromptSet
        from areal_async.inference.client import InferenceClient
        from areal_async.metrics import MetricsLogger
        from areal_async.model.hub import load_tokenizer
        from areal_async.queue.client import QueueClient
        from areal_async.reward.pool import RewardPool

        cfg, inf = self.cfg, self.cfg.inference
        urls = inf.urls()
        self.client = await self.stack.enter_async_context(
            InferenceClient(urls, timeout_s=inf.request_timeout_s, token=auth.job_token(),
                            health_check_interval_s=inf.health_check_interval_s))
        await self.client.wait_healthy(inf.startup_timeout_s)
        self.queue = await self.stack.enter_async_context(
            await QueueClient.connect(cfg.queue.host, cfg.queue.port, timeout_s=60.0, token=auth.job_token()))
        self.logger = MetricsLogger(self.run_dir, cfg.logging, cfg.name, to_dict(cfg), cfg.trainer.total_steps,
                                    resumed_at)
        self.stack.callback(self.logger.close)
        self.rewards = self.stack.enter_context(RewardPool(cfg.reward))
        self.eval_prompts = PromptSet(load_task(cfg.data, "test"), load_tokenizer(cfg.model.path),
                                      cfg.data.max_prompt_len, cfg.seed)
        return self

    async def evaluate(self, version: int, background: bool = False) -> None:
        """Evaluate policy ``version`` (live on every server) and log it at step ``version``,
        showing prompts done (``background``: not as a bar, which the step's bar would garble)."""
        from areal_async.rollout.eval import evaluate

        e = self.cfg.eval
        n = min(e.num_prompts, len(self.eval_prompts))
        mode = "off" if background and progress_mode() == "bar" else None
        with Progress(f"eval of version {version}", n, "prompts", mode=mode) as prog:
            async with _following(prog):
                result = await evaluate(self.client, self.eval_prompts, self.rewards, e.num_prompts,
                                        e.max_new_tokens, version, on_done=prog.update)
        self.logger.log(version, result)

    async def get_batch(self, step: int) -> list[Trajectory]:
        """Batch ``step`` from the queue, showing how many of its groups are ready meanwhile."""
        size = self.cfg.queue.batch_size

        async def ready() -> int:  # ready groups in the queue, up to a batch
            return min((await self.queue.stats()).ready, size)

        with Progress(f"step {step}/{self.cfg.trainer.total_steps}: rollouts", size, "groups") as prog:
            async with _following(prog, ready):
                return await self.queue.get_batch(step)

    async def first_evaluation(self, start: int) -> None:
        """Before step ``start``: evaluate version 0 (``eval.at_start``, a fresh run), or, resumed,
        the checkpoint's version if ``eval.every_steps`` was due there and the stopped job did not
        log it (it was still running in the background)."""
        e = self.cfg.eval
        if start == 0 and e.at_start:
            await self.evaluate(0)
        elif start and e.every_steps and start % e.every_steps == 0 and start < self.cfg.trainer.total_steps \
                and not has_eval_row(self.run_dir / "metrics.jsonl", start):
            await self.evaluate(start)

    def start_evaluation(self, version: int) -> None:
        """Evaluate ``version`` in the background (``eval.every_steps``) while the next step takes
        its batch and trains; ``finish_evaluation`` must be awaited before the next weight send."""
        if self.cfg.eval.every_steps and version % self.cfg.eval.every_steps == 0 and not (
                version == self.cfg.trainer.total_steps and self.cfg.eval.at_end):
            self._evaluation = asyncio.create_task(self.evaluate(version, background=True))

    async def finish_evaluation(self) -> None:
        """Wait for the evaluation ``start_evaluation`` began, if any (its error is raised here)."""
        task, self._evaluation = self._evaluation, None
        if task is not None:
            await task

    async def server_version(self) -> int:
        return min((await self.client.weight_versions()).values())  # of the live servers


def make_sender(cfg: Config, policy, client, run_dir: pathlib.Path, device: torch.device) -> WeightSender:
    """The ``trainer.weight_sync`` implementation, sending in the servers' dtype (``model.dtype``),
    interrupting the generations in flight or waiting for them (``rollout.interrupt_on_update``)."""
    n, dtype = cfg.inference.num_servers, _DTYPES[cfg.model.dtype]
    interrupt = cfg.rollout.interrupt_on_update
    if cfg.trainer.weight_sync == "disk":
        return DiskWeightSender(policy, client, n, cfg.model.path, run_dir / "weights", dtype, interrupt)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return DistributedWeightSender(policy, client, n, address, cfg.trainer.weight_sync_port,
                                   cfg.trainer.weight_bucket_bytes, dtype, device, interrupt)


@contextlib.asynccontextmanager
async def _following(prog: Progress, poll=None):
    """Run ``prog.follow(poll)`` while the block runs."""
    task = asyncio.create_task(prog.follow(poll))
    try:
        yield
    finally:
        task.cancel()


@contextlib.contextmanager
def micro_batch_progress(what: str):
    """A ``train_step`` ``on_micro_batch`` callback that shows the step's micro-batches trained of
    its plan's total while the block runs (host counters only)."""
    with Progress(what, None, "micro-batches trained") as prog:
        def on_micro_batch(done: int, total: int) -> None:
            prog.set_total(total)
            prog.set(done)
        yield on_micro_batch


async def next_batch(services: Services | None, step: int) -> list[Trajectory]:
    """Batch ``step`` from the queue (rank 0), given to every rank over the default group."""
    payload = [msgspec.msgpack.encode(await services.get_batch(step)) if services else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return msgspec.msgpack.decode(payload[0], type=list[Trajectory])


def save_checkpoint(cfg: Config, policy, optimizer, scheduler, run_dir: pathlib.Path, step: int,
                    buffer: list[Trajectory], elapsed_s: float = 0.0) -> None:
    """Collective: rank 0 writes ``RUN_DIR/checkpoint``: the fp32 master weights (HF directory),
    then the training state of ``step`` and the queue's saved ``buffer`` (``resume.py``), all into
    a staging directory that replaces the previous checkpoint only once complete."""
    ckpt = run_dir / "checkpoint"
    state = full_state_dict(policy)
    if state is not None:
        save_hf_checkpoint(state, cfg.model.path, new_staging_dir(ckpt), torch.float32)
    save_training_state(policy, optimizer, scheduler, staging_dir(ckpt), step, buffer, elapsed_s)
    if state is not None:
        publish_checkpoint(ckpt)


async def train(cfg: Config, run_dir: pathlib.Path) -> None:
    deterministic = cfg.mode == "deterministic"
    if deterministic:  # before CUDA / NCCL initialise
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")
    device = init_distributed(cfg.trainer.device)
    rank, t, q = dist.get_rank(), cfg.trainer, cfg.queue
    torch.manual_seed(cfg.seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    ckpt_dir = run_dir / "checkpoint"
    policy = build_policy(str(ckpt_dir) if t.resume else cfg.model.path, t, device, batch_invariant=deterministic)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    scheduler = make_scheduler(optimizer, t)  # stepped once per training step
    start = load_training_state(policy, optimizer, scheduler, ckpt_dir) if t.resume else 0
    # perf/elapsed_s: training wall time from the first step on, summed over resumes (a stopped
    # job's time after its checkpoint, and the pause before the resume, are not counted)
    elapsed_before = read_elapsed(ckpt_dir) if t.resume else 0.0
    if t.resume and rank == 0:  # the steps a stopped job logged after its checkpoint are run again
        for log in ("metrics.jsonl", "trajectories.jsonl"):
            drop_superseded_rows(run_dir / log, start)
    jitter = Jitter(cfg.debug.jitter_ms, cfg.debug.jitter_seed, "trainer", rank, start)
    async with contextlib.AsyncExitStack() as stack:
        services = await Services(cfg, run_dir, stack).start(start if t.resume else None) if rank == 0 else None
        sender = make_sender(cfg, policy, services.client if services else None, run_dir, device)
        await sender.setup()
        if services:
            await services.first_evaluation(start)
        dump = None
        if services and cfg.logging.dump_trajectories:
            dump = stack.enter_context((run_dir / "trajectories.jsonl").open("a" if t.resume else "w"))
        clock = time.monotonic()
        for k in range(start, t.total_steps):
            timer, buffer = Timer(), []
            save = k + 1 == t.total_steps or (t.checkpoint_every and (k + 1) % t.checkpoint_every == 0)
            with timer("step_s"):
                with timer("gen_s"):
                    await jitter()
                    trajs = await next_batch(services, k)
                if deterministic:
                    check_batch(trajs, k, q.batch_size, q.max_staleness, cfg.seed, cfg.rollout.n_samples)
                if dump:
                    dump_batch(dump, k, trajs)
                progress = micro_batch_progress(f"step {k}/{t.total_steps}: training") if services \
                    else contextlib.nullcontext()
                with timer("train_s"), progress as on_micro_batch:
                    metrics = train_step(policy, optimizer, trajs, cfg.algo, t, cfg.rollout.temperature, device,
                                         on_micro_batch=on_micro_batch)
                    scheduler.step()
                if services and deterministic:
                    with timer("gen_s"):
                        await services.queue.wait_drained(k)
                    if save:  # every group of v(g) <= k is finished: the unconsumed ones resume as is
                        buffer = await services.queue.peek_ready(group_id_limit(k, q.batch_size, q.max_staleness))
                if services:
                    with timer("eval_wait_s"):  # an evaluation measures one version: no update while it runs
                        await services.finish_evaluation()
                with timer("weight_sync_s"):
                    await sender.send(k + 1)
                if services:
                    await jitter()
                    await services.queue.set_version(k + 1)
            if services:
                metrics |= batch_metrics(trajs, k, timer.seconds["step_s"])
                # the queue checks its accounting (leased = running + ready + consumed + rejected +
                # requeued, group by group): a violation raises AccountingError and stops the job
                metrics |= queue_metrics(await services.queue.check_accounting())
                metrics |= perf_metrics(timer.seconds, metrics["train/tokens"])
                metrics |= {"version/trainer": k + 1, "version/servers": await services.server_version(),
                            "perf/elapsed_s": elapsed_before + time.monotonic() - clock}
                services.logger.log(k, metrics)
                services.start_evaluation(k + 1)  # after step k's row: wandb's steps only increase
            if save:
                save_checkpoint(cfg, policy, optimizer, scheduler, run_dir, k + 1, buffer,
                                elapsed_before + time.monotonic() - clock)
        if services:
            await services.finish_evaluation()
        if services and cfg.eval.at_end:
            await services.evaluate(t.total_steps)
        if services:
            await services.queue.close()
    dist.barrier()
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when its parent (torchrun) dies, even when the parent is killed
    with SIGKILL and cannot stop its ranks (the launcher gives torchrun the same setting)."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent was already gone
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    import uvloop

    _die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m areal_async.trainer.main", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved RUN_DIR/config.yaml")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    code = 0
    try:
        uvloop.run(train(load_config(args.config), pathlib.Path(args.config).resolve().parent))
    except BaseException as exc:
        traceback.print_exc()
        code = (exc.code or 0) if isinstance(exc, SystemExit) and isinstance(exc.code, (int, type(None))) else 1
    # Leave without interpreter finalization, after success and failure alike: C++ threads of the
    # (destroyed) gloo groups can still be joinable then, and their destructors call std::terminate
    # ("terminate called without an active exception", SIGABRT), which turned a finished run into a
    # failed one; and after a failure a thread can still be blocked in a collective whose peer is
    # gone (a weight broadcast a server refused), which interpreter exit would join.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
