"""Messages that cross process boundaries: a ``Trajectory`` (one scored group: its prompt once, and
per sample the tokens after it with per-token loss mask, behaviour log-prob and version, and
rewards per episode and per turn) and ``Array`` (raw bytes with dtype and shape, never Python
lists)."""

from __future__ import annotations

import numpy as np
import msgspec

from .splitmix import GOLDEN, MIX1, MIX2, mix64


class Array(msgspec.Struct, frozen=True, array_like=True):
    """A dense array as raw little-endian bytes. ``dtype`` is a numpy dtype name."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, values, dtype: str) -> "Array":
        arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
        return cls(dtype=arr.dtype.name, shape=tuple(arr.shape), data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def tolist(self) -> list:
        return self.numpy().tolist()


class EpisodeStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What an episode did besides its tokens (the ``rollout/*`` metrics: docs/metrics.md).

    Fields:
        turns: model turns sampled.
        tool_calls: tool or environment calls made; tool_errors: of those, the ones that
            raised, timed out or went over a limit.
        env_s: wall seconds in tools and the environment (diagnostics only: never compared).
        truncated: cut by ``rollout.max_turns`` or ``rollout.max_episode_tokens``.
        later_prompt_tokens, later_cached_tokens: prompt tokens of turns after the first, and of
            those the ones the server's prefix cache served.
    """

    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    truncated: bool = False
    later_prompt_tokens: int = 0
    later_cached_tokens: int = 0


class Sample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One episode of a group: the tokens after the group's prompt, with per-token fields.

    A single-turn sample is one response: every token of ``output_ids`` was sampled. A multi-turn
    sample (an episode) interleaves the model's turns with the tokens it did not sample (tool
    results, environment messages, template tokens between turns), all of them token ids as the
    engine consumed them. The training sequence is ``prompt_ids + output_ids``; the prompt's
    tokens are never sampled (loss mask 0, log-prob 0, version -1).

    Fields (``L`` tokens after the prompt, ``K`` model turns):
        index: sample index i within the group, ``0 <= i < n_samples``.
        seed: the sampling seed used for this sample (``sample_seed(run_seed, g, i)``).
        output_ids: ``[L] int32`` token ids after the prompt (L may be 0).
        behav_logprobs: ``[L] float32`` log-probs of the sampled tokens under the behaviour
            policy's temperature-scaled distribution, as returned by the server; 0 where not
            sampled (``check`` refuses anything else there: a misaligned mask).
        versions: ``[L] int32`` policy version that produced each sampled token; -1 where not
            sampled (``check`` refuses anything else there).
        finish_reason: ``stop`` | ``length`` | ``abort`` (of the last model turn).
        reward: scaled scalar reward of the whole episode (e.g. +5 / -5).
        correct: whether the verifier accepted the answer.
        reward_error: the verifier raised or timed out (scored as wrong).
        loss_mask: ``[L] uint8``, 1 exactly on the sampled tokens; ``None``: every token was
            sampled (a single-turn response; nothing extra on the wire).
        turn_spans: ``[K, 2] int32`` ``[start, end)`` of each model turn in ``output_ids``,
            ascending and disjoint; every sampled token lies in one. ``None``: no per-turn rewards.
        turn_rewards: ``[K] float32`` reward of each turn (given with ``turn_spans``); how they
            reach the tokens: ``algo.advantages.turn_advantages``.
        stats: the episode's ``EpisodeStats``; ``None``: a single response (one turn, no tools).
    """

    index: int
    seed: int
    output_ids: Array
    behav_logprobs: Array
    versions: Array
    finish_reason: str
    reward: float = 0.0
    correct: bool = False
    reward_error: bool = False
    loss_mask: Array | None = None
    turn_spans: Array | None = None
    turn_rewards: Array | None = None
    stats: EpisodeStats | None = None

    def sampled(self) -> np.ndarray:
        """``[L] bool``: which tokens of ``output_ids`` the model sampled."""
        if self.loss_mask is None:
            return np.ones(self.output_ids.shape[0], dtype=bool)
        return self.loss_mask.numpy().astype(bool)

    def oldest_version(self) -> int | None:
        """The oldest policy version of a sampled token (the sample's version for staleness:
        docs/design.md, Staleness); ``None`` if nothing was sampled (an empty response)."""
        versions = self.versions.numpy()[self.sampled()]
        return int(versions.min()) if versions.size else None

    def check(self) -> None:
        """Raise ``ValueError`` naming the field if the per-token or per-turn fields disagree."""
        n = self.output_ids.shape[0]
        fields = {"behav_logprobs": self.behav_logprobs, "versions": self.versions, "loss_mask": self.loss_mask}
        for name, arr in fields.items():
            if arr is not None and arr.shape != (n,):
                raise ValueError(f"sample {self.index}: {name} has shape {arr.shape}, expected ({n},) like output_ids")
        off = ~self.sampled()
        stray = off & ((self.behav_logprobs.numpy() != 0) | (self.versions.numpy() != -1))
        if np.any(stray):
            t = int(np.flatnonzero(stray)[0])
            raise ValueError(f"sample {self.index}: token {t} is not sampled (loss mask 0) but has behaviour log-prob "
                             f"{self.behav_logprobs.numpy()[t]} and version {self.versions.numpy()[t]}; unsampled "
                             f"tokens carry 0 and -1 (is the loss mask aligned with the tokens?)")
        if (self.turn_spans is None) != (self.turn_rewards is None):
            raise ValueError(f"sample {self.index}: turn_spans and turn_rewards must be given together")
        if self.turn_spans is None:
            return
        spans, k = self.turn_spans.numpy(), self.turn_rewards.shape
        if spans.ndim != 2 or spans.shape[1] != 2 or k != (spans.shape[0],):
            raise ValueError(f"sample {self.index}: turn_spans {spans.shape} must be [K, 2] for K = turn_rewards {k}")
        flat = spans.reshape(-1)
        if flat.size and (flat[0] < 0 or flat[-1] > n or np.any(np.diff(flat) < 0)):
            raise ValueError(f"sample {self.index}: turn_spans {spans.tolist()} must be ascending, disjoint "
                             f"[start, end) spans within [0, {n}]")
        covered = np.zeros(n, dtype=bool)
        for start, end in spans:
            covered[start:end] = True
        if np.any(self.sampled() & ~covered):
            raise ValueError(f"sample {self.index}: sampled token {int(np.flatnonzero(self.sampled() & ~covered)[0])} "
                             f"lies in no turn of turn_spans {spans.tolist()}")


class Trajectory(msgspec.Struct, frozen=True, kw_only=True):
    """One finished group: a prompt and its ``n_samples`` scored samples (episodes).

    Fields:
        group_id: sequence id g of the group (global, 0, 1, 2, ...).
        prompt_ids: ``[P] int32`` the item's prompt token ids (chat template applied), shared by
            every sample of the group and sent once.
        samples: ``n_samples`` samples, ordered by ``Sample.index``.
        data_index: index of the prompt in the training set.
        worker: id of the generation worker that produced it (diagnostics only).
        gen_s: wall-clock seconds from lease to finish (diagnostics only).
    """

    group_id: int
    prompt_ids: Array
    samples: list[Sample]
    data_index: int
    worker: int = 0
    gen_s: float = 0.0

    def min_version(self) -> int:
        """Oldest policy version of any sampled token of this group (``0`` if none)."""
        mins = [v for v in (s.oldest_version() for s in self.samples) if v is not None]
        return min(mins) if mins else 0


def sample_seed(run_seed: int, group_id: int, index: int) -> int:
    """Sampling seed of sample (g, i): a hash of (run seed, g, i), in ``[0, 2**63)``.

    Distinct within a group and independent of which worker or server runs the request
    (docs/design.md, "Determinism"). Uses splitmix64's output function (``splitmix.mix64``) over
    a weighted sum of the three integers.
    """
    return mix64(run_seed * GOLDEN + group_id * MIX1 + index * MIX2) >> 1
