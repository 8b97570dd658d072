"""The deterministic-mode contract on every batch (docs/determinism.md#how): ``check_batch`` raises
``ContractViolation`` on a broken one; ``dump_batch`` writes its deterministic content as one JSON
line (ids, behaviour log-probs as exact floats, rewards, versions, seeds; an episode's segments too)
for run-to-run comparison."""

from __future__ import annotations

import json
from typing import IO

from areal_async.queue.staleness import group_version
from areal_async.types import Sample, Trajectory, sample_seed


SEGMENT_FIELDS = ("prompt_ids", "output_ids", "behav_logprobs", "versions", "loss_mask", "turn_spans")


class ContractViolation(AssertionError):
    """A deterministic-mode batch broke the id/seed/version contract."""


def check_batch(trajs: list[Trajectory], step: int, batch_size: int, max_staleness: int,
                run_seed: int, n_samples: int, start_version: int = 0) -> None:
    """Raise ``ContractViolation`` naming the first broken rule of batch ``step``.

    Args:
        trajs: the batch as the queue returned it.
        step: k; batch_size: B; max_staleness: η; run_seed: the run's ``seed``;
        n_samples: samples per group; start_version: version a resumed run started from.
    """
    ids = [t.group_id for t in trajs]
    expected = list(range(step * batch_size, (step + 1) * batch_size))
    if ids != expected:
        raise ContractViolation(f"batch {step} holds groups {ids}, the contract says {expected}")
    for traj in trajs:
        g = traj.group_id
        want_v = max(group_version(g, batch_size, max_staleness), start_version)
        if [s.index for s in traj.samples] != list(range(n_samples)):
            raise ContractViolation(f"group {g} has sample indices {[s.index for s in traj.samples]}")
        for s in traj.samples:
            if s.seed != sample_seed(run_seed, g, s.index):
                raise ContractViolation(f"sample ({g}, {s.index}) has seed {s.seed}, "
                                        f"expected {sample_seed(run_seed, g, s.index)}")
            versions = set(s.sampled_versions().tolist())  # every sequence's; -1 where not sampled
            if versions - {want_v}:
                raise ContractViolation(f"sample ({g}, {s.index}) has tokens of versions "
                                        f"{sorted(versions)}; v(g) = {want_v}")


def dump_batch(out: IO[str], step: int, trajs: list[Trajectory]) -> None:
    """Append batch ``step`` to ``out`` as one JSON line (no timing or worker fields)."""
    groups = [{
        "group_id": t.group_id, "data_index": t.data_index, "prompt_ids": t.prompt_ids.tolist(),
        "samples": [{
            "index": s.index, "seed": s.seed, "output_ids": s.output_ids.tolist(),
            "behav_logprobs": s.behav_logprobs.tolist(), "versions": s.versions.tolist(),
            "finish_reason": s.finish_reason, "reward": s.reward, "correct": s.correct,
        } | _episode_fields(s) for s in t.samples],
    } for t in trajs]
    out.write(json.dumps({"step": step, "groups": groups}) + "\n")
    out.flush()


def _episode_fields(s: Sample) -> dict:
    """An episode's loss mask, turns and segments, where the sample has them (a single response has
    none)."""
    out = {k: getattr(s, k).tolist() for k in ("loss_mask", "turn_spans", "turn_rewards") if getattr(s, k) is not None}
    if s.segments:
        out["segments"] = [{k: getattr(seg, k).tolist() for k in SEGMENT_FIELDS if getattr(seg, k) is not None}
                           for seg in s.segments]
    return out

