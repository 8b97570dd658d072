"""One episode (g, i) of a group: its model turns, each through ``Episode.generate``, and the
training sequences they make (``Conversation``s: the first starts with the group's prompt).

Turn t of episode (g, i) samples with seed ``turn_seed(sample_seed(seed, g, i), t)`` (turn 0: the
sample's seed itself), request id ``g{g}-s{i}`` (``-t{t}`` after turn 0) and server
``(g * n_samples + i) % num_servers`` for every turn (its prefix cache holds the earlier turns):
functions of (g, i, t), never of timing. A tool that needs randomness gets ``turn_seed(.., t)`` of
the turn whose call it runs. ``to_sample`` turns the record into the ``Sample`` the trainer packs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from areal_async.inference.interface import GenerationClient
from areal_async.rollout.conversation import Conversation
from areal_async.splitmix import MIX1, mix64
from areal_async.types import Array, EpisodeStats, Sample, Segment


class EpisodeTruncated(Exception):
    """The episode reached ``rollout.max_turns`` or ``rollout.max_episode_tokens``."""


class Turn(msgspec.Struct, frozen=True):
    """One model turn as the engine returned it: ``ids`` ``[L]``, ``logprobs`` ``[L]``,
    ``versions`` ``[L]``, ``finish_reason``, ``text`` (``ids`` decoded, for the caller only: never
    encoded again), ``index`` (t), ``seed`` (the turn's sampling seed)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    index: int
    seed: int


def turn_seed(seed: int, turn: int) -> int:
    """Sampling seed of turn ``turn`` of a sample seeded ``seed``: ``seed`` for turn 0, else a
    splitmix64 hash of both, in ``[0, 2**63)``."""
    return seed if turn == 0 else mix64(seed + turn * MIX1) >> 1


class Episode:
    """The record of one episode and the one way its turns are generated.

    Args:
        client: the generation client.
        tokenizer: the model's tokenizer (chat template; decoding for callers).
        decode: ``ids -> text`` for what callers read (special tokens skipped).
        group_id, index, seed: g, i and ``sample_seed(run_seed, g, i)``.
        prompt_ids: the group's prompt ids; messages: the chat turns they render.
        sampling: the run's sampling parameters (``temperature``, ``top_p``, ``top_k``,
            ``stop_token_ids``); per turn, the seed, ``max_new_tokens`` and ``stop`` are added.
        server: the index of the server every turn goes to (failover kept).
        max_new_tokens: per turn; max_turns: model turns at most (``>= 1``);
        max_episode_tokens: tokens after the first prompt of a sequence at most (0: no cap).
        max_seq_len: the servers' context, a sequence's tokens at most (``inference.max_seq_len``;
            0: no cap): a turn gets at most what is left of it.
        name: the request id of turn 0, ``-t{t}`` appended after it; default ``g{g}-s{i}``.
    """

    def __init__(self, client: GenerationClient, tokenizer, decode: Callable[[list[int]], str], group_id: int,
                 index: int, seed: int, prompt_ids: Sequence[int], messages: list[dict[str, Any]],
                 sampling: dict[str, Any], server: int, max_new_tokens: int, max_turns: int,
                 max_episode_tokens: int = 0, name: str | None = None, max_seq_len: int = 0):
        self.client, self.tokenizer, self.decode = client, tokenizer, decode
        self.group_id, self.index, self.seed = group_id, index, seed
        self.name = name or f"g{group_id}-s{index}"
        self.prompt_ids, self.messages = list(prompt_ids), messages
        self._sampling, self._server = sampling, server
        self.max_new_tokens, self.max_turns, self.max_episode_tokens = max_new_tokens, max_turns, max_episode_tokens
        self.max_seq_len = max_seq_len
        self.conversations: list[Conversation] = []
        self.turns: list[Turn] = []
        # EpisodeStats' fields but ``turns`` (counted from ``turns``), as the turns and tools go
        self.stats = {"tool_calls": 0, "tool_errors": 0, "env_s": 0.0, "truncated": False,
                      "later_prompt_tokens": 0, "later_cached_tokens": 0, "env_error": False}

    def start(self, messages: list[dict[str, Any]] | None = None, ids: Sequence[int] | None = None) -> Conversation:
        """A new training sequence: the group's prompt when ``messages`` and ``ids`` are ``None``
        or render to it, else its own prompt (a ``Segment``; the first sequence then stays empty
        unless started before). Returns it; later turns go to the newest."""
        given = messages is not None or ids is not None
        conv = Conversation(self.tokenizer, messages or [], ids) if given else None  # messages rendered once
        if conv is None or (messages is None and conv.ids == self.prompt_ids):
            conv = Conversation(self.tokenizer, self.messages, self.prompt_ids)
        elif conv.ids != self.prompt_ids and not self.conversations:  # the group's sequence stays first, empty
            self.conversations.append(Conversation(self.tokenizer, self.messages, self.prompt_ids))
        self.conversations.append(conv)
        return conv

    @property
    def conversation(self) -> Conversation:
        """The newest training sequence (``start`` first)."""
        if not self.conversations:
            raise RuntimeError("Episode.start() has not been called")
        return self.conversations[-1]

    async def generate(self, stop: Sequence[str] = (), max_new_tokens: int | None = None,
                       record_text: Callable[[str], str] | None = None) -> Turn:
        """Sample the next model turn after the newest conversation's ids and append it there
        (its message's text: ``record_text(text)``, the text the caller was given; default ``text``).

        Raises:
            EpisodeTruncated: ``max_turns`` turns were sampled already, or no token is left of
                ``max_episode_tokens`` or ``max_seq_len`` (the episode is marked truncated).
        """
        conv = self.conversation
        t = len(self.turns)
        asked = min(self.max_new_tokens, max_new_tokens or self.max_new_tokens)
        budget = asked
        if self.max_episode_tokens:
            budget = min(budget, self.max_episode_tokens - (len(conv.ids) - conv.prompt_len))
        if self.max_seq_len:  # an observation may have filled the context: end here, not with the server's 400
            budget = min(budget, self.max_seq_len - len(conv.ids))
        if t >= self.max_turns or budget < 1:
            self.stats["truncated"] = True
            raise EpisodeTruncated(f"episode {self.name}: turn {t} would exceed max_turns {self.max_turns}, "
                                   f"max_episode_tokens {self.max_episode_tokens} or the context "
                                   f"({len(conv.ids)} of max_seq_len {self.max_seq_len} tokens used)")
        seed = turn_seed(self.seed, t)
        sampling = {**self._sampling, "max_new_tokens": budget, "sampling_seed": seed}
        if stop:
            sampling["stop"] = list(stop)
        rid = self.name + (f"-t{t}" if t else "")
        out = await self.client.generate(list(conv.ids), sampling, rid=rid, server=self._server)
        if t:
            self.stats["later_prompt_tokens"] += out.prompt_tokens
            self.stats["later_cached_tokens"] += out.cached_tokens
        turn = Turn(list(out.output_ids), list(out.logprobs), list(out.versions), out.finish_reason,
                    self.decode(out.output_ids), t, seed)
        conv.add_sampled(turn.ids, turn.logprobs, turn.versions, record_text(turn.text) if record_text else turn.text)
        if out.finish_reason == "length" and budget < asked:  # cut by an episode limit, not the turn's own
            self.stats["truncated"] = True
        self.turns.append(turn)
        return turn

    @contextlib.contextmanager
    def timed_env(self) -> Iterator[None]:
        """``with episode.timed_env():`` counts the block's wall seconds as tool/environment time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats["env_s"] += time.perf_counter() - start

    def to_sample(self, reward: float, correct: bool, reward_error: bool = False,
                  turn_rewards: Sequence[float] | None = None) -> Sample:
        """The ``Sample`` of this episode. A single sequence of one sampled turn and no other
        tokens is a plain response: no loss mask, turns or stats on the wire (stats only when it
        was truncated, so that ``rollout/truncated`` counts it). A sequence's tokens
        after its last sampled token (an observation that no turn followed) are left out; a
        sequence with no sampled token is kept whole.

        Raises:
            ValueError: ``turn_rewards`` not one per sampled turn.
        """
        if not self.conversations:
            raise RuntimeError("Episode.start() has not been called")
        first, *rest = [_Trimmed.of(c) for c in self.conversations]
        plain = (not rest and len(self.turns) == 1 and turn_rewards is None and all(first.loss_mask)
                 and not self.stats["env_error"])
        if turn_rewards is not None and len(turn_rewards) != len(self.turns):
            raise ValueError(f"episode {self.name}: {len(turn_rewards)} turn rewards for "
                             f"{len(self.turns)} model turns")
        finish = self.turns[-1].finish_reason if self.turns else "stop"
        bare = plain and not self.stats["truncated"]
        stats = None if bare else EpisodeStats(turns=len(self.turns), **self.stats)
        with_turns = turn_rewards is not None
        return Sample(
            index=self.index, seed=self.seed, output_ids=Array.of(first.output_ids, "int32"),
            behav_logprobs=Array.of(first.behav_logprobs, "float32"), versions=Array.of(first.versions, "int32"),
            finish_reason=finish, reward=reward, correct=correct, reward_error=reward_error,
            loss_mask=None if plain else Array.of(first.loss_mask, "uint8"),
            turn_spans=_spans(first) if with_turns else None,
            turn_rewards=Array.of(list(turn_rewards), "float32") if with_turns else None,
            segments=[Segment(prompt_ids=Array.of(c.prompt_ids, "int32"),
                              output_ids=Array.of(c.output_ids, "int32"),
                              behav_logprobs=Array.of(c.behav_logprobs, "float32"),
                              versions=Array.of(c.versions, "int32"), loss_mask=Array.of(c.loss_mask, "uint8"),
                              turn_spans=_spans(c) if with_turns else None) for c in rest],
            stats=stats)


class _Trimmed(NamedTuple):
    """A ``Conversation``'s prompt and per-token fields up to its last sampled token (all of them
    where it has none): what trails it conditions no trained token, so it would only be packed."""

    prompt_ids: list[int]
    output_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    turn_spans: np.ndarray

    @classmethod
    def of(cls, conv: Conversation) -> "_Trimmed":
        mask = conv.loss_mask
        sampled = np.flatnonzero(mask)
        n = int(sampled[-1]) + 1 if sampled.size else len(mask)
        return cls(conv.ids[:conv.prompt_len], conv.output_ids[:n], conv.behav_logprobs[:n],
                   conv.versions[:n], mask[:n], conv.turn_spans)


def _spans(conv: _Trimmed) -> Array:
    return Array.of(conv.turn_spans, "int32")  # [K, 2]
