"""``Evaluations``: when rank 0 evaluates the served policy (``eval.*``). Invariant: an evaluation
measures one version, so the next weight send awaits ``finish`` (docs/metrics.md#evaluations)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import TYPE_CHECKING

from areal_async.config import Config
from areal_async.inference.interface import GenerationClient
from areal_async.model.source import model_vocab_size
from areal_async.progress import Progress, following, progress_mode
from areal_async.rollout.workflows import build_workflow
from areal_async.trainer.resume import has_eval_row

if TYPE_CHECKING:
    from areal_async.data.prompts import PromptSet
    from areal_async.metrics import MetricsLogger
    from areal_async.reward.pool import RewardPool


class Evaluations:
    """Rank 0's evaluations of the policy the servers hold.

    Args:
        cfg: the run's config (``eval``, ``trainer.total_steps``).
        run_dir: the run directory (its ``metrics.jsonl`` tells whether a version was evaluated).
        client: the inference client.
        prompts: the test prompts; rewards: the reward pool; logger: where results go.
    """

    def __init__(self, cfg: Config, run_dir: pathlib.Path, client: GenerationClient, prompts: PromptSet,
                 rewards: RewardPool, logger: MetricsLogger):
        self._eval, self._total_steps = cfg.eval, cfg.trainer.total_steps
        self._metrics_path = run_dir / "metrics.jsonl"
        self._client, self._prompts, self._rewards, self._logger = client, prompts, rewards, logger
        self._rollout, self._max_seq_len = cfg.rollout, cfg.inference.max_seq_len
        self._workflow = build_workflow(cfg.rollout, rewards, prompts.task.reward_fn, greedy=True,
                                        vocab_size=model_vocab_size(cfg.model.path))
        self._running: asyncio.Task | None = None  # of start()

    async def evaluate(self, version: int, background: bool = False) -> None:
        """Evaluate policy ``version`` (live on every server) and log it at step ``version``,
        showing prompts done (``background``: not as a bar, which the step's bar would garble)."""
        from areal_async.rollout.eval import evaluate

        e = self._eval
        n = min(e.num_prompts, len(self._prompts))
        mode = "off" if background and progress_mode() == "bar" else None
        with Progress(f"eval of version {version}", n, "prompts", mode=mode) as prog:
            async with following(prog):
                result = await evaluate(self._client, self._prompts, self._rewards, e.num_prompts,
                                        e.max_new_tokens, version, on_done=prog.update, workflow=self._workflow,
                                        max_turns=self._rollout.max_turns,
                                        max_episode_tokens=self._rollout.max_episode_tokens,
                                        max_seq_len=self._max_seq_len)
        self._logger.log(version, result)

    async def first(self, start: int) -> None:
        """Before step ``start``: evaluate version 0 (``eval.at_start``, a fresh run), or, resumed,
        the checkpoint's version if ``eval.every_steps`` was due there and the stopped job did not
        log it."""
        e = self._eval
        if start == 0 and e.at_start:
            await self.evaluate(0)
        elif start and e.every_steps and start % e.every_steps == 0 and start < self._total_steps \
                and not has_eval_row(self._metrics_path, start):
            await self.evaluate(start)

    def start(self, version: int) -> None:
        """Evaluate ``version`` in the background (``eval.every_steps``) while the next step takes
        its batch and trains; ``finish`` must be awaited before the next weight send."""
        e = self._eval
        if e.every_steps and version % e.every_steps == 0 and not (version == self._total_steps and e.at_end):
            self._running = asyncio.create_task(self.evaluate(version, background=True))

    async def finish(self) -> None:
        """Wait for the evaluation ``start`` began, if any (its error is raised here)."""
        task, self._running = self._running, None
        if task is not None:
            await task

    async def last(self) -> None:
        """After the last step: wait for a background evaluation, then evaluate the final
        version (``eval.at_end``)."""
        await self.finish()
        if self._eval.at_end:
            await self.evaluate(self._total_steps)
