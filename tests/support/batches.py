"""Trajectories built by hand: small fixed groups for the replay queue (``traj``), and groups of
random tokens near the tiny model's log-probs for the trainer step (``make_trajectories``,
``shared_prefix_trajectories``; seeded, so the same call gives the same batch).
"""

from __future__ import annotations

import numpy as np

from areal_async.types import Array, Sample, Trajectory


def traj(g: int, n: int = 2) -> Trajectory:
    """Group ``g``: ``n`` samples of 2 tokens after a 3-token prompt, version 0, reward 0."""
    samples = [
        Sample(
            index=i, seed=i, output_ids=Array.of([1, 2], "int32"),
            behav_logprobs=Array.of([-0.5, -0.25], "float32"),
            versions=Array.of([0, 0], "int32"), finish_reason="stop",
        )
        for i in range(n)
    ]
    return Trajectory(group_id=g, prompt_ids=Array.of([5, 6, 7], "int32"), samples=samples,
                      data_index=g)


def make_trajectories(vocab: int, seed: int = 0) -> list[Trajectory]:
    """4 groups × 2 samples, varied lengths (one empty response), mixed rewards except group 3.

    Behaviour log-probs are near the tiny model's (≈ -log 384 ≈ -6); sample (2, 1) has -20 on
    every token, so its importance weights exp(-6 + 20) exceed the cap and are dropped.
    """
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(4):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 9)))
        samples = []
        for i in range(2):
            n = 0 if (g, i) == (1, 0) else int(rng.integers(2, 12))
            samples.append(Sample(
                index=i, seed=g * 2 + i,
                output_ids=Array.of(rng.integers(3, vocab, size=n), "int32"),
                behav_logprobs=Array.of(-rng.uniform(5.5, 6.5, size=n) if (g, i) != (2, 1) else
                                        np.full(n, -20.0), "float32"),
                versions=Array.of(np.zeros(n), "int32"), finish_reason="stop",
                reward=5.0 if (i == g % 2 or g == 3) else -5.0,
            ))
        trajs.append(Trajectory(group_id=g, prompt_ids=Array.of(prompt, "int32"), samples=samples, data_index=g))
    return trajs


def shared_prefix_trajectories(vocab: int, seed: int = 0) -> list[Trajectory]:
    """5 groups × 4 samples whose prompts share a 7-token preamble (as few-shot prompts do).

    Group 1 and 3 have all-equal rewards (advantages 0: skipped). Group 2 has an empty response
    (no loss token: skipped) and a response that is a prefix of another; group 4 two identical
    responses. Behaviour log-probs near the tiny model's (≈ -6), so few weights hit the cap.
    """
    rng = np.random.default_rng(seed)
    preamble = rng.integers(3, vocab, size=7)
    trajs = []
    for g in range(5):
        prompt = np.concatenate([preamble, rng.integers(3, vocab, size=int(rng.integers(2, 5)))])
        responses = [rng.integers(3, vocab, size=int(rng.integers(1, 9))) for _ in range(4)]
        if g == 2:
            responses[0] = responses[1][:0]
            responses[2] = responses[3][: max(1, len(responses[3]) // 2)]
        if g == 4:
            responses[1] = responses[0]
        rewards = [5.0] * 4 if g in (1, 3) else [5.0, -5.0, 5.0 if g == 0 else -5.0, -5.0 if g == 4 else 5.0]
        samples = [Sample(index=i, seed=g * 4 + i, output_ids=Array.of(r, "int32"),
                          behav_logprobs=Array.of(-rng.uniform(5.5, 6.5, size=len(r)), "float32"),
                          versions=Array.of(np.zeros(len(r)), "int32"), finish_reason="stop", reward=rewards[i])
                   for i, r in enumerate(responses)]
        trajs.append(Trajectory(group_id=g, prompt_ids=Array.of(prompt, "int32"), samples=samples, data_index=g))
    return trajs
