"""Per-step measurements of the trainer: phase timing (``Timer``) and the metrics of a consumed batch
and of the queue (names: docs/metrics.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from areal_async.types import EpisodeStats, Sample, Trajectory


class Timer:
    """Wall-clock seconds per phase: ``with timer("train_s"): ...`` (adds up over re-entries)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def sample_version(traj: Trajectory, sample: Sample) -> int:
    """Version of a sample = the oldest version of its sampled tokens, segments included
    (docs/design.md, Staleness; for one response, whose versions never decrease, its first
    token's); a sample with no sampled token counts with its group's oldest version."""
    version = sample.oldest_version()
    return traj.min_version() if version is None else version


def batch_metrics(trajs: list[Trajectory], step: int, step_s: float) -> dict:
    """``rollout/*`` and ``staleness/*`` of the batch consumed by training step ``step``.

    ``rollout/reward`` is the mean episode return, the reward plus the sum of the turn
    rewards (what ``algo.turn_rewards = "sum"`` trains on); ``correct`` the verifier's accept rate;
    both over the scored episodes only (``Sample.scored``: not those the environment ended, nor
    ``rollout/empty_episodes``, those with no model turn), and
    left out of the row when the batch has none (no number stands for them: the console line,
    the study's report and wandb skip a missing key);
    ``response_len`` mean sampled tokens per sample (all its sequences); ``no_eos_ratio`` the
    fraction of samples that did not end with a stop token; ``tokens_per_s`` the batch's sampled
    tokens over the step's wall time (in steady state, the generation rate that kept up with
    training); ``multi_version_frac`` the fraction of samples whose sampled tokens span more than
    one policy version (generations interrupted by a weight update and resumed under the next; 0 with
    ``rollout.interrupt_on_update=false``). Staleness of a sample is ``step - version(sample)``;
    ``staleness/hist`` lists them (one per sample), ``version(sample)`` its oldest sampled token's.
    """
    samples = [(t, s) for t in trajs for s in t.samples]
    n = max(len(samples), 1)
    versions = [s.sampled_versions().tolist() for _, s in samples]  # sampled tokens of every sequence
    lengths = [len(v) for v in versions]  # sampled tokens (a response: all)
    staleness = [step - sample_version(t, s) for t, s in samples]
    scored = [s for _, s in samples if s.scored()]
    returns = {"rollout/reward": sum(s.episode_return() for s in scored) / len(scored),
               "rollout/correct": sum(s.correct for s in scored) / len(scored)} if scored else {}
    return returns | {
        "rollout/response_len": sum(lengths) / n,
        "rollout/no_eos_ratio": sum(s.finish_reason != "stop" for _, s in samples) / n,
        "rollout/reward_errors": float(sum(s.reward_error for _, s in samples)),
        "rollout/env_errors": float(sum(s.env_failed() for _, s in samples)),
        "rollout/empty_episodes": float(sum(s.empty() for _, s in samples)),
        "rollout/tokens_per_s": sum(lengths) / max(step_s, 1e-9),
        "rollout/multi_version_frac": sum(len(set(v)) > 1 for v in versions) / n,
        "staleness/mean": sum(staleness) / n,
        "staleness/max": float(max(staleness, default=0)),
        "staleness/hist": [float(x) for x in staleness],
    } | episode_metrics(trajs)


def episode_metrics(trajs: list[Trajectory]) -> dict:
    """What the batch's episodes did (``Sample.stats``; a single response: one turn, nothing
    else): ``rollout/turns``, ``tool_calls``, ``tool_errors`` and ``env_s`` (seconds in tools and
    the environment), means per episode; ``rollout/episode_s``: mean seconds from a group's lease
    to its last episode's end; ``rollout/truncated``: the fraction cut by a turn or length limit;
    ``rollout/prefix_cache_hit``: of the prompt tokens of turns after the first, the fraction the
    prefix cache served (absent when no episode had a second turn)."""
    stats = [s.stats or EpisodeStats() for t in trajs for s in t.samples]
    n = max(len(stats), 1)
    later = sum(x.later_prompt_tokens for x in stats)
    out = {
        "rollout/turns": sum(x.turns for x in stats) / n,
        "rollout/tool_calls": sum(x.tool_calls for x in stats) / n,
        "rollout/tool_errors": sum(x.tool_errors for x in stats) / n,
        "rollout/env_s": sum(x.env_s for x in stats) / n,
        "rollout/episode_s": sum(t.gen_s for t in trajs) / max(len(trajs), 1),
        "rollout/truncated": sum(x.truncated for x in stats) / n,
    }
    if later:
        out["rollout/prefix_cache_hit"] = sum(x.later_cached_tokens for x in stats) / later
    return out


def queue_metrics(stats) -> dict:
    """``queue/*`` from a ``QueueStats`` snapshot, and ``rollout/worker_restarts`` (the
    launcher's restarts of dead workers so far), ``rollout/server_failures`` and
    ``rollout/server_restarts`` (inference servers it found dead or hung, and started again, so
    far); ``queue/released``: groups handed back by a dead worker so far (generated again),
    ``queue/requeued``: those of them not leased again yet."""
    out = {f"queue/{k}": float(getattr(stats, k))
           for k in ("ready", "running", "rejected", "capacity", "requeued", "released")}
    return out | {f"rollout/{k}": float(getattr(stats, k))
                  for k in ("worker_restarts", "server_failures", "server_restarts")}


def perf_metrics(seconds: dict[str, float], tokens: float) -> dict:
    """``perf/*`` from a step's ``Timer``; ``gpu_idle_frac`` = share of the step the trainer's
    devices did not train (waiting for data, syncing weights)."""
    step_s = seconds.get("step_s", 0.0)
    train_s = seconds.get("train_s", 0.0)
    out = {f"perf/{k}": v for k, v in seconds.items()}
    out["perf/trained_tokens_per_s"] = tokens / max(train_s, 1e-9)
    out["perf/gpu_idle_frac"] = 1.0 - train_s / step_s if step_s > 0 else 0.0
    return out
