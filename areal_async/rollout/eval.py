"""Greedy pass@1 on the first ``num_prompts`` prompts of the test split, one policy version at a time.

One greedy episode per prompt (temperature 0, seed 0) through the run's workflow, prompt j to server
``j % num_servers`` (request id ``eval-{j}``), all in flight at once. Invariant: every token's
``weight_version`` is the evaluated version, else ``MixedVersionError`` (when it runs:
docs/metrics.md#evaluations).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from areal_async.data.prompts import PromptSet
from areal_async.inference.interface import GenerationClient
from areal_async.reward.math import extract_boxed
from areal_async.reward.pool import RewardPool
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EpisodeItem, ToolLoop, Workflow


class MixedVersionError(RuntimeError):
    """An evaluation's responses came from more than the one policy version it was to measure."""


async def evaluate(client: GenerationClient, prompts: PromptSet, rewards: RewardPool, num_prompts: int,
                   max_new_tokens: int, version: int,
                   on_done: Callable[[], None] | None = None, workflow: Workflow | None = None,
                   max_turns: int = 1, max_episode_tokens: int = 0, max_seq_len: int = 0) -> dict[str, float]:
    """Greedy pass@1 of the served policy (version ``version``).

    Args:
        client: an ``InferenceClient``, or a stand-in for it.
        prompts: the test prompts (``PromptSet`` of the task's ``"test"`` split).
        rewards: the reward pool; scores with ``prompts.task.reward_fn`` (given the item's chat
            turns and row, as the generation worker does).
        num_prompts: how many of the first test prompts to use (capped at ``len(prompts)``; dataset
            order, after length filtering).
        max_new_tokens: response budget per prompt (``>= 1``).
        version: the policy version the servers hold for the whole evaluation.
        on_done: called once per scored prompt (progress display).
        workflow: the episodes' workflow (``workflows.build_workflow(..., greedy=True)``); ``None``:
            one answer per prompt. max_turns, max_episode_tokens: its limits (``rollout.*``);
            max_seq_len: the servers' context (``inference.max_seq_len``; 0: no cap).

    Returns:
        ``eval/pass@1`` (fraction correct), ``eval/response_len`` (mean output tokens),
        ``eval/boxed_ratio`` (fraction with a non-empty ``\\boxed{}``), ``eval/num_prompts``,
        ``eval/version`` (``version``, which every token came from).

    Raises:
        ValueError: ``num_prompts < 1`` or ``max_new_tokens < 1``.
        MixedVersionError: a token came from a version other than ``version``.
    """
    if num_prompts < 1 or max_new_tokens < 1:
        raise ValueError(f"evaluate needs num_prompts >= 1 and max_new_tokens >= 1, got "
                         f"{num_prompts}, {max_new_tokens}")
    n = min(num_prompts, len(prompts))
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": prompts.stop_token_ids}
    workflow = workflow or ToolLoop(rewards, prompts.task.reward_fn)
    seen: set[int] = set()  # weight versions of every token of every response

    async def one(j: int) -> tuple[bool, int, bool]:
        item = prompts.at(j)
        messages = prompts.task.messages(item.data_index)
        ep = Episode(client, prompts.tokenizer, prompts.decode, -1, j, 0, item.prompt_ids, messages, sampling,
                     server=j % len(client.urls), max_new_tokens=max_new_tokens, max_turns=max_turns,
                     max_episode_tokens=max_episode_tokens, name=f"eval-{j}", max_seq_len=max_seq_len)
        sample = await workflow(ep, EpisodeItem(messages, item.gold, item.row, item.data_index))
        seen.update(v for turn in ep.turns for v in turn.versions)
        if on_done is not None:
            on_done()
        boxed = bool(ep.turns) and bool(extract_boxed(ep.turns[-1].text))
        return sample.correct, sum(len(turn.ids) for turn in ep.turns), boxed

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(j)) for j in range(n)]
    results = [t.result() for t in tasks]
    if seen - {version}:
        raise MixedVersionError(
            f"the evaluation of policy version {version} got tokens of weight versions {sorted(seen)}: a "
            f"weight update reached the servers while it ran; the trainer must wait for an evaluation "
            f"before it sends the next version")
    return {
        "eval/pass@1": sum(c for c, _, _ in results) / n,
        "eval/response_len": sum(length for _, length, _ in results) / n,
        "eval/boxed_ratio": sum(b for _, _, b in results) / n,
        "eval/num_prompts": float(n),
        "eval/version": float(version),
    }
