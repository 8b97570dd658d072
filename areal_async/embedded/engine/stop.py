"""Stop strings: matched on the detokenized output, after each new token, as SGLang's scheduler
matches them, over a window wide enough for any spelling.

``StopStrings.match`` looks for the stop strings in the decoded last ``window`` output tokens.
SGLang 0.5.23 decodes ``len(encode(stop)) + 1`` tokens, so it misses a stop string the model
spells with more tokens than its canonical encoding (one character a token, say). Here ``window``
is ``max(len(encode(stop)), len(stop.encode("utf-8"))) + 1``, as SGLang's open PR #36728 has it:
every token of a spelling holds at least one of the stop string's bytes (true of byte-level BPE
and SentencePiece vocabularies; a token that decodes to nothing could still hide one), and the
extra token gives the decoder the context of the first one (a SentencePiece leading space).
The cost is one ``decode`` of ``window`` tokens per request per step (``tools/bench_stop.py``).
``answer_text`` keeps every token and cuts the text at the match; ``hold_back`` keeps a stream
from sending text the answer may cut. A pure function of the output tokens (deterministic mode
replays it), run on the event loop at commit. SGLang's rule: docs/sglang_api.md#generation.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopStrings:
    """The stop strings of one request and the tokenizer that spells them.

    Args:
        strings: the stop strings, non-empty, in the request's order (the first that occurs wins).
        tokenizer: an HF tokenizer (``encode`` / ``decode``).
    """

    def __init__(self, strings: tuple[str, ...], tokenizer):
        assert strings and all(strings), f"stop strings must be non-empty, got {strings!r}"
        self.strings = strings
        self._decode: Callable[[list[int]], str] = tokenizer.decode
        # the longest spelling's tokens (each holds a byte at least: module docstring), + 1 of context
        self.window = max(max(len(tokenizer.encode(s, add_special_tokens=False)), len(s.encode("utf-8")))
                          for s in strings) + 1

    def match(self, output_ids: list[int]) -> str | None:
        """The first stop string found in the decoded last ``window`` tokens of ``output_ids``
        (call after each new token), or ``None``."""
        tail = self._decode(output_ids[-self.window:])
        return next((s for s in self.strings if s in tail), None)


def trim(text: str, matched: str, no_stop_trim: bool) -> str:
    """``text`` cut at the first occurrence of the stop string ``matched`` (SGLang's
    ``trim_matched_stop``): before it, or just after it with ``no_stop_trim``; unchanged when
    ``matched`` does not occur (e.g. it was in special-token text that ``text`` skips)."""
    pos = text.find(matched)
    if pos == -1:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]


def answer_text(tokenizer, output_ids: list[int], matched: int | str | None, skip_special_tokens: bool,
                spaces_between_special_tokens: bool, no_stop_trim: bool) -> str:
    """The text SGLang's detokenizer answers for ``output_ids``: a matched stop token (``matched``
    an int, the last id) dropped and the text cut at a matched stop string, unless
    ``no_stop_trim``; ``output_ids`` themselves keep every token. ``/generate`` and ``/v1`` alike."""
    shown = output_ids[:-1] if isinstance(matched, int) and not no_stop_trim else output_ids
    text = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)
    return trim(text, matched, no_stop_trim) if isinstance(matched, str) else text


def hold_back(text: str, stops: Sequence[str]) -> str:
    """``text`` of a running request less any tail that begins one of the stop strings ``stops``
    (it may be cut from the answer once the stop completes), so a stream never sends text that the
    final answer trims (``/generate``'s chunks and ``/v1``'s deltas alike)."""
    cut = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), cut, -1):
            if text.endswith(stop[:k]):
                cut = k
                break
    return text[: len(text) - cut]
