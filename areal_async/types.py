"""Messages that cross process boundaries: a ``Trajectory`` (one scored group: its prompt once, and
per sample the tokens after it with per-token loss mask, behaviour log-prob and version, the
episode's further sequences (``Segment``), and rewards per episode and per turn) and ``Array``
(raw bytes with dtype and shape, never Python lists)."""

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
        env_error: the environment failed and ended the episode (``rollout.on_env_error: zero``);
            its sequences are not trained and its return enters no statistics (``trainer/plan.py``),
            nor does an episode's with ``turns`` 0 (``Sample.empty``).
    """

    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    truncated: bool = False
    later_prompt_tokens: int = 0
    later_cached_tokens: int = 0
    env_error: bool = False


def _sampled(output_ids: Array, loss_mask: Array | None) -> np.ndarray:
    """``[L] bool``: a sequence's sampled tokens (``loss_mask`` ``None``: all of ``output_ids``)."""
    if loss_mask is None:
        return np.ones(output_ids.shape[0], dtype=bool)
    return loss_mask.numpy().astype(bool)


def _check_tokens(where: str, output_ids: Array, behav_logprobs: Array, versions: Array, loss_mask: Array | None,
                  sampled: np.ndarray) -> None:
    """Raise ``ValueError`` (message starts with ``where``) if the per-token fields of one sequence
    disagree: shapes other than ``[L]`` like ``output_ids``, or a log-prob other than 0 / a version
    other than -1 on a token with loss mask 0."""
    n = output_ids.shape[0]
    fields = {"behav_logprobs": behav_logprobs, "versions": versions, "loss_mask": loss_mask}
    for name, arr in fields.items():
        if arr is not None and arr.shape != (n,):
            raise ValueError(f"{where}: {name} has shape {arr.shape}, expected ({n},) like output_ids")
    stray = ~sampled & ((behav_logprobs.numpy() != 0) | (versions.numpy() != -1))
    if np.any(stray):
        t = int(np.flatnonzero(stray)[0])
        raise ValueError(f"{where}: token {t} is not sampled (loss mask 0) but has behaviour log-prob "
                         f"{behav_logprobs.numpy()[t]} and version {versions.numpy()[t]}; unsampled "
                         f"tokens carry 0 and -1 (is the loss mask aligned with the tokens?)")


def _check_spans(where: str, turn_spans: Array, n: int, sampled: np.ndarray) -> int:
    """Raise ``ValueError`` (message starts with ``where``) unless ``turn_spans`` is ``[k, 2]``,
    ascending, disjoint, within ``[0, n]`` and covers every sampled token; returns ``k``."""
    spans = turn_spans.numpy()
    if spans.ndim != 2 or spans.shape[1] != 2:
        raise ValueError(f"{where}: turn_spans has shape {spans.shape}, expected [k, 2]")
    flat = spans.reshape(-1)
    if flat.size and (flat[0] < 0 or flat[-1] > n or np.any(np.diff(flat) < 0)):
        raise ValueError(f"{where}: turn_spans {spans.tolist()} must be ascending, disjoint "
                         f"[start, end) spans within [0, {n}]")
    covered = np.zeros(n, dtype=bool)
    for start, end in spans:
        covered[start:end] = True
    if np.any(sampled & ~covered):
        raise ValueError(f"{where}: sampled token {int(np.flatnonzero(sampled & ~covered)[0])} "
                         f"lies in no turn of turn_spans {spans.tolist()}")
    return spans.shape[0]


class Segment(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A further training sequence of an episode, ``prompt_ids + output_ids``: started where a call
    did not extend the recorded conversation. Its prompt is never sampled (loss mask 0).

    Fields (``P`` prompt tokens, ``L`` after it, ``k`` model turns), conventions as ``Sample``'s:
        prompt_ids: ``[P] int32``, ``P >= 1``: the call's full prompt.
        output_ids: ``[L] int32``.
        behav_logprobs: ``[L] float32``, 0 where not sampled.
        versions: ``[L] int32``, -1 where not sampled.
        loss_mask: ``[L] uint8`` or ``None`` (every token sampled).
        turn_spans: ``[k, 2] int32`` ``[start, end)`` in ``output_ids``, or ``None``; given exactly
            when the episode has ``turn_rewards``.
    """

    prompt_ids: Array
    output_ids: Array
    behav_logprobs: Array
    versions: Array
    loss_mask: Array | None = None
    turn_spans: Array | None = None

    def sampled(self) -> np.ndarray:
        """``[L] bool``: which tokens of ``output_ids`` the model sampled."""
        return _sampled(self.output_ids, self.loss_mask)


class Sample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One episode of a group: the tokens after the group's prompt, with per-token fields, and the
    episode's further training sequences (``segments``).

    A single-turn sample is one response: every token of ``output_ids`` was sampled. A multi-turn
    sample (an episode) interleaves the model's turns with the tokens it did not sample (tool
    results, environment messages, template tokens between turns), all of them token ids as the
    engine consumed them. The first training sequence is ``prompt_ids + output_ids``; the prompt's
    tokens are never sampled (loss mask 0, log-prob 0, version -1). Each ``Segment`` is one more
    sequence ``segment.prompt_ids + segment.output_ids`` of the same episode.

    Fields (``L`` tokens after the prompt, ``K`` model turns of the whole episode):
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
        turn_spans: ``[K0, 2] int32`` ``[start, end)`` of each model turn in ``output_ids``,
            ascending and disjoint; every sampled token lies in one. ``None``: no per-turn rewards.
        turn_rewards: ``[K] float32`` reward of each turn of the episode, in order: the ``K0`` of
            ``turn_spans``, then each segment's. Given with ``turn_spans`` and every segment's
            ``turn_spans``; how they reach the tokens: ``algo.advantages.turn_advantages``.
        segments: the episode's further training sequences, in order (empty: one sequence).
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
    segments: list[Segment] = []

    def sampled(self) -> np.ndarray:
        """``[L] bool``: which tokens of ``output_ids`` (the first sequence) the model sampled;
        a segment's: ``Segment.sampled()``."""
        return _sampled(self.output_ids, self.loss_mask)

    def sampled_versions(self) -> np.ndarray:
        """``[N] int32``: the version of every sampled token of every sequence of the episode (the
        first, then each segment's), ``N`` the episode's sampled tokens."""
        parts = [self.versions.numpy()[self.sampled()]]
        parts += [seg.versions.numpy()[seg.sampled()] for seg in self.segments]
        return np.concatenate(parts).astype(np.int32, copy=False)

    def env_failed(self) -> bool:
        """Its environment failed and ended it (``EpisodeStats.env_error``): not trained."""
        return self.stats is not None and self.stats.env_error

    def empty(self) -> bool:
        """An episode with no model turn (``EpisodeStats.turns`` 0: an agent that made no call, a
        first observation that filled the context) that its environment did not end: nothing of it
        is trained, and its reward says nothing about the policy."""
        return self.stats is not None and self.stats.turns == 0 and not self.stats.env_error

    def scored(self) -> bool:
        """Its return enters the statistics (``rollout/reward``, ``rollout/correct``, the group's
        baseline, ``algo.batch_norm``): its environment did not end it and it is not ``empty``."""
        return not self.env_failed() and not self.empty()

    def episode_return(self) -> float:
        """``reward`` plus the sum of ``turn_rewards`` (float64): the episode's return R_i."""
        turns = self.turn_rewards
        return self.reward + (float(turns.numpy().sum(dtype="float64")) if turns is not None else 0.0)

    def oldest_version(self) -> int | None:
        """The oldest policy version of a sampled token of any sequence of the episode (the
        sample's version for staleness: docs/design.md, Staleness); ``None`` if nothing was
        sampled (an empty response)."""
        versions = self.sampled_versions()
        return int(versions.min()) if versions.size else None

    def check(self) -> None:
        """Raise ``ValueError`` naming the sample, the segment (``segment k``) where it is one, and
        the field if the per-token or per-turn fields disagree, or if the turns of all sequences
        do not add up to ``turn_rewards``."""
        where = f"sample {self.index}"
        _check_tokens(where, self.output_ids, self.behav_logprobs, self.versions, self.loss_mask, self.sampled())
        for k, seg in enumerate(self.segments):
            if seg.prompt_ids.shape[0] < 1:
                raise ValueError(f"{where}: segment {k}: prompt_ids is empty (a sequence needs a prompt)")
            _check_tokens(f"{where}: segment {k}", seg.output_ids, seg.behav_logprobs, seg.versions, seg.loss_mask,
                          seg.sampled())
        if (self.turn_spans is None) != (self.turn_rewards is None):
            raise ValueError(f"{where}: turn_spans and turn_rewards must be given together")
        for k, seg in enumerate(self.segments):
            if (seg.turn_spans is None) != (self.turn_rewards is None):
                raise ValueError(f"{where}: segment {k}: turn_spans must be given exactly when the sample has "
                                 f"turn_rewards")
        if self.turn_spans is None:
            return
        if self.turn_rewards.numpy().ndim != 1:
            raise ValueError(f"{where}: turn_rewards has shape {self.turn_rewards.shape}, expected [K]")
        total = _check_spans(where, self.turn_spans, self.output_ids.shape[0], self.sampled())
        counts = [total]
        for k, seg in enumerate(self.segments):
            counts.append(_check_spans(f"{where}: segment {k}", seg.turn_spans, seg.output_ids.shape[0],
                                       seg.sampled()))
        if sum(counts) != self.turn_rewards.shape[0]:
            raise ValueError(f"{where}: turn_rewards has {self.turn_rewards.shape[0]} turns but the turn_spans of "
                             f"its sequences have {sum(counts)} (first {counts[0]}, segments {counts[1:]})")


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
        """Oldest policy version of any sampled token of any sequence of this group (``0`` if
        none)."""
        mins = [v for v in (s.oldest_version() for s in self.samples) if v is not None]
        return min(mins) if mins else 0


def sample_seed(run_seed: int, group_id: int, index: int) -> int:
    """Sampling seed of sample (g, i): a hash of (run seed, g, i), in ``[0, 2**63)``.

    Distinct within a group and independent of which worker or server runs the request
    (docs/design.md, "Determinism"). Uses splitmix64's output function (``splitmix.mix64``) over
    a weighted sum of the three integers.
    """
    return mix64(run_seed * GOLDEN + group_id * MIX1 + index * MIX2) >> 1
