"""The generation worker: leases group ids, generates and scores each group, streams it back.

    python -m areal_async.rollout.worker --config RUN_DIR/config.yaml --worker-id I

Invariant: episode i of group g has prompt ``PromptSet.for_group(g)``, seed ``sample_seed(seed, g,
i)``, and its turns' seeds, request ids and server follow from (g, i, turn) (``episode.py``), never
from timing or from which worker runs it. Each episode runs the workflow (``workflows.py``) and is
scored as it ends; the group's ``Trajectory`` is submitted when its last one is; at most
``rollout.max_groups_in_flight`` groups are in flight. A closed queue cancels them and exits 0; any
error cancels everything and exits non-zero (docs/faults.md#a-generation-worker-dies).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from areal_async import auth
from areal_async.config import Config, DebugConfig, RolloutConfig, load_config
from areal_async.data.prompts import PromptItem, PromptSet
from areal_async.jitter import Jitter
from areal_async.inference.interface import GenerationClient
from areal_async.queue.interface import WorkerQueue
from areal_async.reward.pool import RewardPool
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EpisodeItem, ToolLoop, Workflow, build_workflow
from areal_async.types import Array, Sample, Trajectory, sample_seed


class GenerationWorker:
    """Runs groups for one worker id until the queue closes.

    Args:
        worker_id: this worker's id (``--worker-id``).
        queue: a ``QueueClient`` or an in-process ``ReplayQueue``.
        client: an ``InferenceClient``, or a stand-in for it.
        prompts: the training prompts.
        rewards: the reward pool; responses are scored with ``prompts.task.reward_fn``, given the
            item's chat turns and row for a keyword-form function.
        rollout: ``n_samples``, ``max_new_tokens``, sampling parameters, ``max_groups_in_flight``.
        seed: the run seed (sampling seeds derive from it).
        debug: ``jitter_ms``, ``jitter_seed``.
        workflow: what each episode does (``workflows.build_workflow``); ``None``: one answer each,
            scored with ``prompts.task.reward_fn``.
    """

    def __init__(self, worker_id: int, queue: WorkerQueue, client: GenerationClient, prompts: PromptSet,
                 rewards: RewardPool, rollout: RolloutConfig, seed: int, debug: DebugConfig = DebugConfig(),
                 workflow: Workflow | None = None, max_seq_len: int = 0):
        if rollout.n_samples < 1 or rollout.max_groups_in_flight < 1 or rollout.max_new_tokens < 1:
            raise ValueError(
                f"rollout.n_samples ({rollout.n_samples}), max_groups_in_flight "
                f"({rollout.max_groups_in_flight}) and max_new_tokens ({rollout.max_new_tokens}) "
                f"must all be >= 1")
        self.worker_id = worker_id
        self._queue, self._client = queue, client
        self._prompts, self._rewards = prompts, rewards
        self._rollout, self._seed, self._max_seq_len = rollout, seed, max_seq_len
        self._jitter = Jitter(debug.jitter_ms, debug.jitter_seed, worker_id)
        self._workflow = workflow or ToolLoop(rewards, prompts.task.reward_fn)
        self._in_flight = 0
        self._slot_freed = asyncio.Event()
        self.groups_done = 0
        self.samples_done = 0
        self.tokens_done = 0

    async def run(self) -> None:
        """Lease and run groups until the queue closes. Raises whatever a group raised."""
        limit = self._rollout.max_groups_in_flight
        async with asyncio.TaskGroup() as tg:
            tasks: set[asyncio.Task] = set()
            while True:
                # Backpressure: lease only for free slots, so this worker never holds more than
                # max_groups_in_flight groups (leased groups count against the staleness bound).
                while self._in_flight >= limit:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                group_ids = await self._queue.lease(self.worker_id, limit - self._in_flight)
                if not group_ids:
                    break
                for g in group_ids:
                    self._in_flight += 1
                    task = tg.create_task(self._run_group(g), name=f"group-{g}")
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            for task in tasks:  # the queue is closed: these groups would never be trained
                task.cancel()

    async def _run_group(self, g: int) -> None:
        t0 = time.perf_counter()
        try:
            item = self._prompts.for_group(g)
            messages = self._prompts.task.messages(item.data_index)  # the group's prompt, as chat turns
            async with asyncio.TaskGroup() as tg:
                pending = [tg.create_task(self._run_sample(g, i, item, messages))
                           for i in range(self._rollout.n_samples)]
            samples = [t.result() for t in pending]
            await self._queue.submit(Trajectory(
                group_id=g, prompt_ids=Array.of(item.prompt_ids, "int32"), samples=samples,
                data_index=item.data_index, worker=self.worker_id,
                gen_s=time.perf_counter() - t0,
            ))
            self.groups_done += 1
        finally:
            self._in_flight -= 1
            self._slot_freed.set()

    async def _run_sample(self, g: int, i: int, item: PromptItem, messages: list[dict]) -> Sample:
        await self._jitter()  # injected timing noise (debug.jitter_ms), never on by default
        r = self._rollout
        sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "stop_token_ids": self._prompts.stop_token_ids}
        episode = Episode(self._client, self._prompts.tokenizer, self._prompts.decode, g, i,
                          sample_seed(self._seed, g, i), item.prompt_ids, messages, sampling,
                          server=(g * r.n_samples + i) % len(self._client.urls), max_new_tokens=r.max_new_tokens,
                          max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens, max_seq_len=self._max_seq_len)
        sample = await self._workflow(episode, EpisodeItem(messages, item.gold, item.row, item.data_index))
        sample.check()
        self.samples_done += 1
        self.tokens_done += sum(len(t.ids) for t in episode.turns)
        return sample


async def main(cfg: Config, worker_id: int) -> None:
    from areal_async.data import load_task
    from areal_async.data.prompt_cache import cache_dir_of
    from areal_async.inference.client import InferenceClient, job_lora_path
    from areal_async.model.source import load_tokenizer, model_vocab_size, resolve_model_path
    from areal_async.queue.client import QueueClient

    tag = f"[worker{worker_id}]"
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path)
    prompts = PromptSet(load_task(cfg.data, "train"), tokenizer, cfg.data.max_prompt_len,
                        cfg.seed, cache_dir_of(cfg))
    print(f"{tag} {prompts.summary()}", flush=True)
    inf = cfg.inference
    urls = inf.urls()
    t0 = time.perf_counter()
    with RewardPool(cfg.reward) as rewards:
        async with InferenceClient(urls, timeout_s=inf.request_timeout_s, token=auth.job_token(),
                                   health_check_interval_s=inf.health_check_interval_s,
                                   max_pause_s=inf.max_pause_s,
                                   rejoin_timeout_s=inf.server_rejoin_timeout_s,
                                   lora_path=job_lora_path(inf.backend, cfg.trainer.lora.rank)) as client:
            await client.wait_healthy(inf.startup_timeout_s)
            queue = await QueueClient.connect(cfg.queue.host, cfg.queue.port, timeout_s=60.0, token=auth.job_token())
            async with queue:
                workflow = build_workflow(cfg.rollout, rewards, prompts.task.reward_fn,
                                          vocab_size=model_vocab_size(model_path))
                worker = GenerationWorker(worker_id, queue, client, prompts, rewards, cfg.rollout, cfg.seed,
                                          cfg.debug, workflow, max_seq_len=inf.max_seq_len)
                await worker.run()
        elapsed = time.perf_counter() - t0
        print(f"{tag} queue closed: {worker.groups_done} groups, {worker.samples_done} samples, "
              f"{worker.tokens_done / max(elapsed, 1e-9):.1f} tok/s; {rewards.stats()}",
              flush=True)


def cli(argv: list[str] | None = None) -> None:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m areal_async.rollout.worker")
    parser.add_argument("--config", required=True, help="the run's resolved config.yaml")
    parser.add_argument("--worker-id", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(main(load_config(args.config), args.worker_id))


if __name__ == "__main__":
    cli()
