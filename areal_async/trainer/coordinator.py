"""Rank 0's duties in the trainer loop (``Coordinator``) and their twin on the other ranks (``Follower``).

``main.train`` drives the object ``connect`` gives its rank through the same calls; per step k::

    take(k) → Learner.step (showing training(k)) → publish(k + 1) → log(k, ...) → settle(k)

take: batch k from the queue, to every rank, checked; publish: [drain] → [running evaluation] →
weights → version announced; log: metrics, then the next evaluation if due; settle: checkpoint if
due. Invariant: a follower's call joins the coordinator's collectives, in the same order, and does
nothing else; deterministic mode's check and drain are chosen once. docs/trainer.md#the-loop.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import IO, TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from areal_async import auth
from areal_async.config import Config, TrainerConfig, to_dict
from areal_async.jitter import Jitter
from areal_async.progress import Progress, following
from areal_async.queue.interface import TrainerQueue
from areal_async.queue.staleness import group_id_limit
from areal_async.trainer.contract import check_batch, dump_batch
from areal_async.trainer.evaluation import Evaluations
from areal_async.trainer.learner import Learner
from areal_async.trainer.report import Timer, batch_metrics, perf_metrics, queue_metrics
from areal_async.trainer.resume import drop_superseded_rows
from areal_async.trainer.weight_sync import WeightSender
from areal_async.types import Trajectory

if TYPE_CHECKING:
    from areal_async.inference.client import InferenceClient
    from areal_async.metrics import MetricsLogger

# make_sender(cfg, policy, client, run_dir, device): the weight sender of this rank (client: rank
# 0's inference client, None elsewhere)
SenderFactory = Callable[[Config, torch.nn.Module, "InferenceClient | None", pathlib.Path, torch.device],
                         WeightSender]
ContractCheck = Callable[[list[Trajectory], int], None]


def checkpoint_due(steps_done: int, t: TrainerConfig) -> bool:
    """Whether a checkpoint is written once ``steps_done`` steps are done: every
    ``t.checkpoint_every`` steps (0: none) and after the last (``t.total_steps``)."""
    return steps_done == t.total_steps or bool(t.checkpoint_every and steps_done % t.checkpoint_every == 0)


def contract_check(cfg: Config) -> ContractCheck:
    """``check(trajs, k)``: ``contract.check_batch`` of batch k in deterministic mode; in throughput
    mode batches have no contract and it checks nothing."""
    if cfg.mode != "deterministic":
        return lambda trajs, k: None
    q, n = cfg.queue, cfg.rollout.n_samples
    return lambda trajs, k: check_batch(trajs, k, q.batch_size, q.max_staleness, cfg.seed, n)


async def connect(cfg: Config, run_dir: pathlib.Path, learner: Learner, stack: contextlib.AsyncExitStack,
                  make_sender: SenderFactory) -> Coordinator | Follower:
    """This rank's part of the loop, its weight sender set up: on rank 0 a ``Coordinator`` with
    every connection open (``stack`` closes them) and the first evaluation done, elsewhere a
    ``Follower``."""
    rank = dist.get_rank()
    if rank == 0:
        return await Coordinator.open(cfg, run_dir, learner, stack, make_sender)
    sender = make_sender(cfg, learner.policy, None, run_dir, learner.device)
    await sender.setup()
    return Follower(cfg, learner, sender, Jitter(cfg.debug.jitter_ms, cfg.debug.jitter_seed, "trainer", rank,
                                                 learner.start))


def _broadcast_batch(payload: bytes | None) -> list[Trajectory]:
    """Collective: rank 0's msgpack-encoded batch (``None`` on the other ranks), decoded on every
    rank."""
    box = [payload]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return msgspec.msgpack.decode(box[0], type=list[Trajectory])


@contextlib.contextmanager
def micro_batch_progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A ``train_step`` ``on_micro_batch`` callback that shows the step's micro-batches trained of
    its plan's total while the block runs (host counters only)."""
    with Progress(what, None, "micro-batches trained") as prog:
        def on_micro_batch(done: int, total: int) -> None:
            prog.set_total(total)
            prog.set(done)
        yield on_micro_batch


class Coordinator:
    """Rank 0: the replay queue, the inference servers, the metrics log, the evaluations.

    Build with ``await Coordinator.open(...)`` (which connects and sets up ``sender``); the
    constructor takes the open connections. ``perf/elapsed_s`` counts from construction.

    Args:
        cfg: the run's config. learner: this rank's ``Learner``.
        sender: the weight sender (set up). jitter: this rank's ``Jitter``.
        client: the inference client; queue: the replay queue (its client, or an in-process one);
            logger: the metrics log.
        evals: the evaluation schedule. dump: ``trajectories.jsonl``, open, or ``None``.
    """

    def __init__(self, cfg: Config, learner: Learner, sender: WeightSender, jitter: Jitter,
                 client: InferenceClient, queue: TrainerQueue, logger: MetricsLogger, evals: Evaluations,
                 dump: IO[str] | None):
        self._cfg, self._learner, self._sender, self._jitter = cfg, learner, sender, jitter
        self._client, self._queue, self._logger, self._evals, self._dump = client, queue, logger, evals, dump
        self._check = contract_check(cfg)
        self._drain: Callable[[int, Timer], Awaitable[None]] = (
            self._wait_drained if cfg.mode == "deterministic" else self._no_drain)
        self._kept: list[Trajectory] = []  # the ready groups publish() kept for settle()'s checkpoint
        self._clock = time.monotonic()

    @classmethod
    async def open(cls, cfg: Config, run_dir: pathlib.Path, learner: Learner, stack: contextlib.AsyncExitStack,
                   make_sender: SenderFactory) -> Coordinator:
        """Drop the rows a resumed run logs again, connect to the servers (waiting until healthy)
        and the queue, open the metrics log and the reward pool, set up the weight sender, run the
        first evaluation (``Evaluations.first``) and open ``trajectories.jsonl``; ``stack`` closes
        what was opened."""
        from areal_async.data import load_task
        from areal_async.data.prompt_cache import cache_dir_of
        from areal_async.data.prompts import PromptSet
        from areal_async.inference.client import InferenceClient, job_lora_path
        from areal_async.metrics import MetricsLogger
        from areal_async.model.source import load_tokenizer
        from areal_async.queue.client import QueueClient
        from areal_async.reward.pool import RewardPool

        t, inf = cfg.trainer, cfg.inference
        if t.resume:  # the steps a stopped job logged after its checkpoint are run again
            for log in ("metrics.jsonl", "trajectories.jsonl"):
                drop_superseded_rows(run_dir / log, learner.start)
        jitter = Jitter(cfg.debug.jitter_ms, cfg.debug.jitter_seed, "trainer", 0, learner.start)
        client = await stack.enter_async_context(
            InferenceClient(inf.urls(), timeout_s=inf.request_timeout_s, token=auth.job_token(),
                            health_check_interval_s=inf.health_check_interval_s,
                            max_pause_s=inf.max_pause_s,
                            rejoin_timeout_s=inf.server_rejoin_timeout_s,
                            lora_path=job_lora_path(inf.backend, t.lora.rank)))  # the evaluation's /generate
        await client.wait_healthy(inf.startup_timeout_s)
        queue = await stack.enter_async_context(
            await QueueClient.connect(cfg.queue.host, cfg.queue.port, timeout_s=60.0, token=auth.job_token()))
        # a resumed job starts a new wandb run (metrics.MetricsLogger)
        logger = MetricsLogger(run_dir, cfg.logging, cfg.name, to_dict(cfg), t.total_steps,
                               learner.start if t.resume else None)
        stack.callback(logger.close)
        rewards = stack.enter_context(RewardPool(cfg.reward))
        prompts = PromptSet(load_task(cfg.data, "test"), load_tokenizer(cfg.model.path), cfg.data.max_prompt_len,
                            cfg.seed, cache_dir_of(cfg))
        if prompts.num_filtered:  # the workers print the training split's line
            print(f"[trainer] test split: {prompts.summary()}", flush=True)
        evals = Evaluations(cfg, run_dir, client, prompts, rewards, logger)
        sender = make_sender(cfg, learner.policy, client, run_dir, learner.device)
        await sender.setup()
        await evals.first(learner.start)
        dump = None
        if cfg.logging.dump_trajectories:
            dump = stack.enter_context((run_dir / "trajectories.jsonl").open("a" if t.resume else "w"))
        return cls(cfg, learner, sender, jitter, client, queue, logger, evals, dump)

    async def take(self, k: int, timer: Timer) -> list[Trajectory]:
        """Collective: batch ``k`` from the queue, given to every rank, checked, dumped; the wait
        for it is timed as ``gen_s``."""
        with timer("gen_s"):
            await self._jitter()
            trajs = _broadcast_batch(msgspec.msgpack.encode(await self._get_batch(k)))
        self._check(trajs, k)
        if self._dump is not None:
            dump_batch(self._dump, k, trajs)
        return trajs

    def training(self, k: int) -> contextlib.AbstractContextManager[Callable[[int, int], None] | None]:
        """Around step ``k``'s training: its ``on_micro_batch`` callback (progress display)."""
        return micro_batch_progress(f"step {k}/{self._cfg.trainer.total_steps}: training")

    async def publish(self, version: int, timer: Timer) -> None:
        """Collective: make ``version`` live on every server and announce it to the queue (after
        the drain of deterministic mode and any running evaluation)."""
        await self._drain(version - 1, timer)
        with timer("eval_wait_s"):  # an evaluation measures one version: no update while it runs
            await self._evals.finish()
        with timer("weight_sync_s"):
            await self._sender.send(version)
        await self._jitter()
        await self._queue.set_version(version)

    async def log(self, k: int, trajs: list[Trajectory], metrics: dict, timer: Timer) -> None:
        """Log step ``k``: ``metrics`` (``train/*``) plus those of batch ``trajs``, the queue, the
        step's ``timer`` and the versions; then start the evaluation of version k+1 if due."""
        metrics |= batch_metrics(trajs, k, timer.seconds["step_s"])
        # the queue checks its accounting (leased = running + ready + consumed + rejected +
        # requeued, group by group): a violation raises AccountingError and stops the job
        metrics |= queue_metrics(await self._queue.check_accounting())
        metrics |= perf_metrics(timer.seconds, metrics["train/tokens"])
        metrics |= {"version/trainer": k + 1, "version/servers": await self._server_version(),
                    "perf/elapsed_s": self._elapsed_s()}
        self._logger.log(k, metrics)
        self._evals.start(k + 1)  # after step k's row: wandb's steps only increase

    async def settle(self, k: int) -> None:
        """Collective: after step ``k``, the checkpoint of version k+1 if one is due."""
        if checkpoint_due(k + 1, self._cfg.trainer):
            kept, self._kept = self._kept, []
            self._learner.save_checkpoint(k + 1, kept, self._elapsed_s())

    async def finish(self) -> None:
        """After the last step: the last evaluations, then close the queue (workers stop)."""
        await self._evals.last()
        await self._queue.close()

    async def _get_batch(self, step: int) -> list[Trajectory]:
        """Batch ``step`` from the queue, showing how many of its groups are ready meanwhile."""
        size = self._cfg.queue.batch_size

        async def ready() -> int:  # ready groups in the queue, up to a batch
            return min((await self._queue.stats()).ready, size)

        with Progress(f"step {step}/{self._cfg.trainer.total_steps}: rollouts", size, "groups") as prog:
            async with following(prog, ready):
                return await self._queue.get_batch(step)

    async def _wait_drained(self, k: int, timer: Timer) -> None:
        """Deterministic mode: wait (``gen_s``) until every group of version ≤ ``k`` has finished;
        before a checkpoint keep the ready ones (the resumed queue restores them as is)."""
        with timer("gen_s"):
            await self._queue.wait_drained(k)
        if checkpoint_due(k + 1, self._cfg.trainer):  # every group of v(g) <= k is finished
            q = self._cfg.queue
            self._kept = await self._queue.peek_ready(group_id_limit(k, q.batch_size, q.max_staleness))

    async def _no_drain(self, k: int, timer: Timer) -> None:
        """Throughput mode: versions go live without waiting; a checkpoint keeps no groups."""

    async def _server_version(self) -> int:
        return min((await self._client.weight_versions()).values())  # of the live servers

    def _elapsed_s(self) -> float:
        return self._learner.elapsed_before_s + time.monotonic() - self._clock


class Follower:
    """Ranks 1..N-1: the coordinator's calls, each joining only the collectives it holds (the batch
    broadcast, the weight send, the checkpoint). Args as ``Coordinator``'s."""

    def __init__(self, cfg: Config, learner: Learner, sender: WeightSender, jitter: Jitter):
        self._cfg, self._learner, self._sender, self._jitter = cfg, learner, sender, jitter
        self._check = contract_check(cfg)

    async def take(self, k: int, timer: Timer) -> list[Trajectory]:
        with timer("gen_s"):
            await self._jitter()
            trajs = _broadcast_batch(None)
        self._check(trajs, k)
        return trajs

    def training(self, k: int) -> contextlib.AbstractContextManager[Callable[[int, int], None] | None]:
        return contextlib.nullcontext()

    async def publish(self, version: int, timer: Timer) -> None:
        with timer("weight_sync_s"):
            await self._sender.send(version)

    async def log(self, k: int, trajs: list[Trajectory], metrics: dict, timer: Timer) -> None:
        """Nothing: rank 0 logs."""

    async def settle(self, k: int) -> None:
        if checkpoint_due(k + 1, self._cfg.trainer):  # rank 0 alone writes the groups and elapsed time
            self._learner.save_checkpoint(k + 1, [], 0.0)

    async def finish(self) -> None:
        """Nothing: rank 0 evaluates and closes the queue."""
