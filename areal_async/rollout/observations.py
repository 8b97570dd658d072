"""What an ``Env``'s ``reset`` and ``step`` may return as an observation, checked where it enters
the episode: ``None``, a list of chat messages (dicts with ``role``), or token ids (a non-empty
list or tuple of ints or numpy integers, or a 1-d numpy integer array; each below the vocabulary).
From ``step`` an empty list is no new message (as ``None``); from ``reset`` it is refused (the
item's messages are ``None``). A message has a string ``role`` and a ``content`` that is a string
or a non-empty list of text parts (``{"type": "text", "text": str}``), joined into one string before
the chat template renders it (a template may write the list as its repr, or drop it). Anything
else is a programming error: ``TypeError``/``ValueError`` naming the method, the episode and turn,
the value and the accepted forms, under any ``rollout.on_env_error``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

ACCEPTED = ("None, a list of chat messages (dicts with a string 'role' and 'content'), or a non-empty list of "
            "token ids (ints)")


def first(obs, vocab: Callable[[], int], source: str,
          where: str) -> tuple[list[dict] | None, Sequence[int] | None]:
    """``Episode.start``'s ``(messages, ids)`` for ``reset``'s observation.

    Raises:
        TypeError / ValueError: an observation of no accepted form (an empty list included), or
            an id outside the vocabulary; naming ``source`` and ``where``.
    """
    if obs is None:
        return None, None
    if isinstance(obs, (list, tuple)) and not len(obs):
        raise ValueError(f"{source} returned an empty observation {obs!r} in {where}; return None to start "
                         f"from the item's messages, or the first messages or token ids")
    ids, messages = _parse(obs, source, where)
    return (None, _in_vocab(ids, vocab, source, where)) if ids is not None else (messages, None)


def extend(conv, obs, vocab: Callable[[], int], source: str, where: str) -> None:
    """Append ``step``'s observation to ``conv`` (``None`` or ``[]``: the template's tokens only).

    Raises:
        TypeError / ValueError: as ``first`` (an empty list is accepted).
    """
    if obs is None or (isinstance(obs, (list, tuple)) and not len(obs)):
        conv.add_messages([])
        return
    ids, messages = _parse(obs, source, where)
    if ids is not None:
        conv.add_ids(_in_vocab(ids, vocab, source, where))
    else:
        conv.add_messages(messages)


def _parse(obs, source: str, where: str) -> tuple[list[int] | None, list[dict] | None]:
    """``(ids, None)`` or ``(None, messages)`` of a non-empty observation."""
    if isinstance(obs, np.ndarray) and obs.ndim == 1 and obs.size and np.issubdtype(obs.dtype, np.integer):
        return [int(t) for t in obs], None
    if isinstance(obs, (list, tuple)) and obs:
        if all(_is_id(t) for t in obs):
            return [int(t) for t in obs], None
        if all(isinstance(m, dict) and "role" in m for m in obs):
            return None, [_message(m, k, source, where) for k, m in enumerate(obs)]
    shown = f"{type(obs).__name__} {' '.join(repr(obs).split()):.120}"
    raise TypeError(f"{source} returned the observation {shown} in {where}; an observation is {ACCEPTED} "
                    f"(a numpy integer array passes too)")


def _message(m: dict, k: int, source: str, where: str) -> dict:
    """Message ``k`` of an observation, text parts joined.

    Raises:
        TypeError: a ``role`` that is no string, or no ``content`` that is a string or a non-empty
            list of text parts; naming ``source``, ``where`` and the message.
    """
    content = m.get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(m["role"], str) or not isinstance(content, str):
        shown = " ".join(repr(m).split())
        raise TypeError(f"{source} returned the message {k} {shown:.160} in {where}; a chat message has a string "
                        f"'role' and a 'content' that is a string (or a list of text parts, "
                        f"{{'type': 'text', 'text': ...}}, joined)")
    return {**m, "content": content}


def _is_id(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _in_vocab(ids: list[int], vocab_size: Callable[[], int], source: str, where: str) -> list[int]:
    """``ids``, each in ``[0, vocab)``, ``vocab = vocab_size()``.

    ``vocab`` is the model's embedding rows (its config's ``vocab_size``) where known, else
    ``len(tokenizer)``: the embedding is often padded past the tokenizer (Qwen2.5: 151936 rows,
    151665 tokens), and the engine and the trainer accept any id below its rows; an id past them
    would reach the engine and fail there (on a GPU, a device-side assert that names nothing).

    Raises:
        ValueError: an id outside ``[0, vocab)``, naming ``source``, ``where``, the id and the range.
    """
    vocab = vocab_size()
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{source} gave the observation token id {bad} in {where}, outside the vocabulary "
                         f"[0, {vocab}); give ids of the model's tokenizer (tokenizer.encode), or chat messages")
    return ids
