"""The token record of one multi-turn episode: the exact ids the engine consumed and produced.

A ``Conversation`` starts from the episode's first chat messages rendered with the generation
prompt. Each model turn is appended as the engine returned it (``add_sampled``: ids, behaviour
log-probs, versions; loss mask 1); sampled ids are never decoded and re-encoded. Between turns only
the tokens of new messages are appended (``add_messages``, loss mask 0): the chat template renders
the history with a sentinel in place of the last model turn's content, and the text after the
sentinel (the turn's closing, the new messages, the next generation prompt) is tokenised alone; the
end-of-turn token is not appended again when the model sampled it. ``add_ids`` appends an
observation given as ids. ``extension`` tells whether a caller's full message list only extends the
recorded one (else a new sample must start). ``cut_at_stop`` drops a turn's tokens after the token
that completes a stop string.

Per-token fields cover the tokens after the prompt (``L`` of them): ``loss_mask [L] uint8``,
``behav_logprobs [L] float32`` (0 where not sampled), ``versions [L] int32`` (-1 where not
sampled); ``turn_spans [K, 2] int32`` ``[start, end)`` of each model turn, over the same tokens.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

# Stands in for the last model turn's content when the template renders the history; no template
# splits, strips or escapes it (no whitespace at its ends, no markup).
_SENTINEL = "Xq7SENTINELz9Kv"
# The message fields ``extension`` compares; a key whose value is None counts as absent.
MESSAGE_FIELDS = ("role", "content", "tool_calls", "name", "tool_call_id")


class SampledTurn(NamedTuple):
    """A model turn as the engine returned it (``add_sampled(*turn)`` takes it as is)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str


def _normalized(message: dict) -> dict | None:
    """``message`` with None-valued keys dropped and text-only content parts joined into one
    string; None when it has a key outside ``MESSAGE_FIELDS`` (it cannot be compared)."""
    out = {k: v for k, v in message.items() if v is not None}
    if set(out) - set(MESSAGE_FIELDS):
        return None
    content = out.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        out["content"] = "".join(p.get("text", "") for p in content)
    return out


class Conversation:
    """The ids of one episode so far, with the per-token fields of the tokens after the prompt.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        messages: the episode's first chat messages (ending with a user turn), copied.
        prompt_ids: their rendering with the generation prompt as the engine was given it, used as
            is; None: rendered here (``apply_chat_template``, ``add_generation_prompt=True``).
        chat_template_kwargs: extra arguments of every ``apply_chat_template`` call (e.g. ``tools``,
            ``enable_thinking``).
    """

    def __init__(self, tokenizer, messages: Sequence[dict], prompt_ids: Sequence[int] | None = None,
                 chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.messages: list[dict] = [dict(m) for m in messages]
        if prompt_ids is None:
            prompt_ids = self._encode(self._render(self.messages))
        self.ids: list[int] = [int(t) for t in prompt_ids]
        self.prompt_len = len(self.ids)
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._spans: list[tuple[int, int]] = []
        self._last = "prompt"  # what was appended last: prompt | sampled | messages | ids

    # ---- per-token fields (over the tokens after the prompt) ----------------------------------------

    @property
    def output_ids(self) -> np.ndarray:
        """``[L] int32``: the ids after the prompt."""
        return np.asarray(self.ids[self.prompt_len:], dtype=np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        """``[L] uint8``: 1 exactly on sampled tokens."""
        return np.asarray(self._mask, dtype=np.uint8)

    @property
    def behav_logprobs(self) -> np.ndarray:
        """``[L] float32``: the engine's log-prob of each sampled token, 0 elsewhere."""
        return np.asarray(self._logprobs, dtype=np.float32)

    @property
    def versions(self) -> np.ndarray:
        """``[L] int32``: the policy version of each sampled token, -1 elsewhere."""
        return np.asarray(self._versions, dtype=np.int32)

    @property
    def turn_spans(self) -> np.ndarray:
        """``[K, 2] int32``: ``[start, end)`` of each model turn, ascending and disjoint."""
        return np.asarray(self._spans, dtype=np.int32).reshape(-1, 2)

    # ---- appending -----------------------------------------------------------------------------------

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], text: str,
                    message: dict | None = None) -> None:
        """Append a model turn exactly as the engine returned it (loss mask 1), and record its
        message: ``message`` as the caller received it, default ``{"role": "assistant",
        "content": text}``.

        Raises:
            ValueError: the lengths of ``ids``, ``logprobs`` and ``versions`` differ, or ``ids`` is
                empty.
        """
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"a sampled turn needs one log-prob and one version per token: len(ids)={len(ids)}, "
                             f"len(logprobs)={len(logprobs)}, len(versions)={len(versions)}")
        if not len(ids):
            raise ValueError("a sampled turn needs at least one token: len(ids)=0")
        start = len(self._mask)
        self.ids.extend(int(t) for t in ids)
        self._mask.extend([1] * len(ids))
        self._logprobs.extend(float(x) for x in logprobs)
        self._versions.extend(int(v) for v in versions)
        self._spans.append((start, start + len(ids)))
        self.messages.append(dict(message) if message is not None else {"role": "assistant", "content": text})
        self._last = "sampled"

    def add_messages(self, new_messages: Sequence[dict]) -> list[int]:
        """Append (loss mask 0) what the template writes after the last model turn's content: the
        turn's closing (less its end-of-turn token when the model sampled it), ``new_messages``
        (tool results, user turns) and the generation prompt. Returns the appended ids.

        Raises:
            ValueError: the last thing appended is not a sampled turn, or the template does not
                write the last turn's content verbatim.
        """
        if self._last != "sampled":
            raise ValueError(f"add_messages follows a sampled turn; the last thing appended was the {self._last}")
        new_messages = [dict(m) for m in new_messages]
        history = self.messages[:-1] + [{"role": "assistant", "content": _SENTINEL}]
        text = self._render(history + new_messages)
        if text.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not write an assistant message's content verbatim, so the "
                             "tokens after a model turn cannot be told apart")
        added = self._encode(text.partition(_SENTINEL)[2])
        last = self.ids[-1]
        if added and added[0] == last and last in self._special_ids():
            added = added[1:]  # the model sampled the end-of-turn token itself
        self._append_unsampled(added)
        self.messages.extend(new_messages)
        self._last = "messages"
        return added

    def add_ids(self, ids: Sequence[int]) -> None:
        """Append an observation given as token ids, verbatim (loss mask 0). The recorded messages
        no longer describe the ids, so ``extension`` answers None from now on."""
        self._append_unsampled([int(t) for t in ids])
        self._last = "ids"

    def extension(self, messages: Sequence[dict]) -> list[dict] | None:
        """The messages that ``messages`` adds to the recorded ones, or None when it does not only
        extend them (an edited history, stripped reasoning, a key outside ``MESSAGE_FIELDS``), or
        when they cannot be appended (the last thing appended is not a sampled turn, and there are
        new messages; or ``add_ids`` was used). Messages are equal when their normalized dicts are
        (None-valued keys dropped, text-only content parts joined)."""
        if self._last == "ids" or len(messages) < len(self.messages):
            return None
        for mine, theirs in zip(self.messages, messages):
            a, b = _normalized(mine), _normalized(theirs)
            if a is None or a != b:
                return None
        new = [dict(m) for m in messages[len(self.messages):]]
        if new and self._last != "sampled":
            return None
        return new

    # ---- helpers -------------------------------------------------------------------------------------

    def _append_unsampled(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self._mask.extend([0] * len(ids))
        self._logprobs.extend([0.0] * len(ids))
        self._versions.extend([-1] * len(ids))

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _special_ids(self) -> set[int]:
        return set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)


def cut_at_stop(ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str]) -> SampledTurn:
    """Cut a sampled turn after the token that completes the first stop string in its text; the
    tokens after it are dropped (never in context, never trained). ``decode`` turns ids into text
    (e.g. ``tokenizer.decode``); it only locates the cut. Returns the kept ids, log-probs, versions
    and their decoded text; the whole turn when no stop string occurs.

    Raises:
        ValueError: the lengths of ``ids``, ``logprobs`` and ``versions`` differ.
    """
    if not len(ids) == len(logprobs) == len(versions):
        raise ValueError(f"a sampled turn needs one log-prob and one version per token: len(ids)={len(ids)}, "
                         f"len(logprobs)={len(logprobs)}, len(versions)={len(versions)}")
    stops = [s for s in stop_strings if s]

    def stopped(n: int) -> bool:
        text = decode(list(ids[:n]))
        return any(s in text for s in stops)

    n = len(ids)
    if stops and stopped(n):
        lo, hi = 1, n  # the shortest prefix whose text holds a stop string: stopped(hi) holds
        while lo < hi:
            mid = (lo + hi) // 2
            if stopped(mid):
                hi = mid
            else:
                lo = mid + 1
        n = hi
    return SampledTurn(list(ids[:n]), list(logprobs[:n]), list(versions[:n]), decode(list(ids[:n])))
