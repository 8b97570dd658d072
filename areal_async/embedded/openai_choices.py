"""The choices of a ``/v1`` answer, in SGLang 0.5.23's shapes: text, log-probs and token ids.

``CompletionFormat`` / ``ChatFormat`` shape a finished choice and a stream's chunks; ``Returns``
says what a request asked for beyond the text. Log-probs are the engine's own, one per output
token (``Completion.logprobs``, the numbers ``/generate`` returns; never recomputed); a token's
text is its id decoded alone, special tokens kept (SGLang's ``return_text_in_logprobs``).
Completions: ``{text_offset, token_logprobs, tokens, top_logprobs}`` (``to_openai_style_logprobs``):
``text_offset`` -1 and ``top_logprobs`` ``[]`` as SGLang's, a token that is a fragment of a UTF-8
character written one character per raw byte (latin-1). Chat: ``{content: [{token, bytes, logprob,
top_logprobs: []}]}``, ``bytes`` the token's raw bytes in a byte-level BPE vocabulary (a character
split over tokens is their concatenation), else its text's UTF-8. The engine computes no top-k
alternatives; the request check refuses asking for them. A completions chunk carries the tokens
since the last chunk; a chat chunk carries them with its text, and tokens that brought no text go
with the next text chunk or the finishing one (SGLang drops them), so a choice's chunks carry every
token once. Token ids: SGLang's ``return_token_ids`` (chat: plain answers only, as SGLang),
``return_prompt_token_ids`` and chat's ``sglext`` ids (``openai_api._Call.sglext``).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from .engine.engine import Completion


def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` table inverted: the printable character a byte-level BPE
    vocabulary stores for each byte → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for c, b in zip(chars, printable)}


BYTE_DECODER = _byte_decoder()


class LogprobRenderer:
    """OpenAI-shaped log-probs of one tokenizer's tokens (the module docstring says how)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_level: bool | None = None

    @property
    def byte_level(self) -> bool:
        """Whether the vocabulary stores tokens as GPT-2 byte characters (SGLang's
        ``_is_byte_level_tokenizer``: the tokenizer's ``is_byte_level`` if it has one, else every
        character of six sampled tokens is in the byte table)."""
        if self._byte_level is None:
            flag = getattr(self.tokenizer, "is_byte_level", None)
            if isinstance(flag, bool):
                self._byte_level = flag
            else:
                vocab = len(self.tokenizer.get_vocab())
                pieces = [self.tokenizer.convert_ids_to_tokens(i) for i in (0, 1, 2, 3, vocab // 2, vocab - 2)
                          if 0 <= i < vocab]
                self._byte_level = all(ch in BYTE_DECODER for piece in pieces if piece for ch in piece)
        return self._byte_level

    def texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone (special tokens kept), as SGLang's ``detokenize_logprob_tokens``."""
        return self.tokenizer.batch_decode([[t] for t in ids]) if ids else []

    def raw_bytes(self, token_id: int) -> list[int] | None:
        """The token's own bytes in a byte-level vocabulary; ``None`` where the tokenizer is not
        byte-level or the token has a character outside the byte table (SGLang's ``token_id_to_bytes``)."""
        if not self.byte_level:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not piece or any(ch not in BYTE_DECODER for ch in piece):
            return None
        return [BYTE_DECODER[ch] for ch in piece]

    def _lossless(self, token_id: int, text: str) -> str:
        """``text``, or for a fragment of a UTF-8 character (its raw bytes are not valid UTF-8) those
        bytes as latin-1, one character each (SGLang's ``_lossless_token_text``)."""
        if "\ufffd" not in text:
            return text
        raw = self.raw_bytes(token_id)
        if raw is None:
            return text
        try:
            bytes(raw).decode("utf-8")
            return text  # a whole character (e.g. U+FFFD itself): keep its text
        except UnicodeDecodeError:
            return bytes(raw).decode("latin-1")

    def completion(self, ids: list[int], logprobs: list[float]) -> dict:
        """``/v1/completions``' ``logprobs`` of tokens ``ids`` (one log-prob each)."""
        assert len(ids) == len(logprobs), f"{len(ids)} tokens with {len(logprobs)} log-probs"
        tokens = [self._lossless(t, s) for t, s in zip(ids, self.texts(ids))]
        return {"text_offset": [-1] * len(ids), "token_logprobs": list(logprobs), "tokens": tokens,
                "top_logprobs": []}

    def chat(self, ids: list[int], logprobs: list[float]) -> dict:
        """``/v1/chat/completions``' ``logprobs`` of tokens ``ids`` (one log-prob each)."""
        assert len(ids) == len(logprobs), f"{len(ids)} tokens with {len(logprobs)} log-probs"
        content = []
        for t, text, lp in zip(ids, self.texts(ids), logprobs):
            raw = self.raw_bytes(t)
            content.append({"token": text, "bytes": list(text.encode("utf-8")) if raw is None else raw,
                            "logprob": lp, "top_logprobs": []})
        return {"content": content}


class Returns(msgspec.Struct, frozen=True, kw_only=True):
    """What an answer carries beyond the text, as SGLang's request fields ask for it: ``logprobs``
    (each choice's); ``token_ids`` (``return_token_ids``: completions' ``token_ids`` and
    ``prompt_token_ids``, chat's ``prompt_token_ids`` and ``response_token_ids``); ``prompt_ids``
    (chat's ``return_prompt_token_ids``); chat's response-level ``sglext`` ids
    (``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext``, or their ``x-sglext-``
    headers; ``ids_framed``: a stream sends them as an ``event: sglext_ids``)."""

    logprobs: bool = False
    token_ids: bool = False
    prompt_ids: bool = False
    sglext_input_ids: bool = False
    sglext_output_ids: bool = False
    ids_framed: bool = False


def matched(c: Completion):
    """The ``matched_stop`` of a choice: the stop token id or string of a ``stop``, else ``None``."""
    return c.matched if c.finish_reason == "stop" else None


class Format(Protocol):
    """How one endpoint shapes its answer: ``object`` / ``chunk_object`` name a plain answer and a
    stream's chunk."""

    object: str
    chunk_object: str

    def choice(self, index: int, text: str, c: Completion, prompt: list[int]) -> dict:
        """Choice ``index`` of a plain answer: the finished ``c`` of ``prompt``, decoded as ``text``."""

    def carries(self, delta: str, c: Completion) -> bool:
        """Whether the chunks of an update with text ``delta`` carry its new tokens' log-probs and
        ids; those of an update that does not go with the next that does."""

    def stream_events(self, index: int, first: bool, delta: str, c: Completion, new: slice | None,
                      prompt: list[int]) -> list[dict]:
        """The stream choices for an update of choice ``index`` (``first``: its first), ``delta``
        its text since the last one, ``new`` the positions of ``c.output_ids`` they carry (``None``:
        none); ``c.finish_reason`` is set on its last update."""


class CompletionFormat:
    """``/v1/completions``' choices (``text``); a stream sends one chunk per engine update."""

    object = chunk_object = "text_completion"

    def __init__(self, render: LogprobRenderer, returns: Returns):
        self.render, self.returns = render, returns

    def _choice(self, index: int, text: str, c: Completion, new: slice, prompt: list[int] | None) -> dict:
        ids = c.output_ids[new]
        logprobs = self.render.completion(ids, c.logprobs[new]) if self.returns.logprobs else None
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
               "matched_stop": matched(c)}
        if self.returns.token_ids:
            out["token_ids"] = ids
            if prompt is not None:
                out["prompt_token_ids"] = prompt
        return out

    def choice(self, index: int, text: str, c: Completion, prompt: list[int]) -> dict:
        return self._choice(index, text, c, slice(None), prompt)

    def carries(self, delta: str, c: Completion) -> bool:
        return True  # every chunk: one per engine chunk, as SGLang sends them

    def stream_events(self, index: int, first: bool, delta: str, c: Completion, new: slice | None,
                      prompt: list[int]) -> list[dict]:
        event = self._choice(index, delta, c, new, prompt if first else None)
        if not c.output_ids[new]:
            event["logprobs"] = None  # no token since the last chunk: SGLang sends no log-probs
        return [event]


class ChatFormat:
    """``/v1/chat/completions``' choices (``message``); a stream opens a choice with its role, then
    sends content deltas, then a finishing chunk."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, render: LogprobRenderer, returns: Returns):
        self.render, self.returns = render, returns

    def choice(self, index: int, text: str, c: Completion, prompt: list[int]) -> dict:
        message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
        logprobs = self.render.chat(c.output_ids, c.logprobs) if self.returns.logprobs else None
        out = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason,
               "matched_stop": matched(c)}
        if self.returns.prompt_ids or self.returns.token_ids:
            out["prompt_token_ids"] = prompt
        if self.returns.token_ids:
            out["response_token_ids"] = c.output_ids
        return out

    def carries(self, delta: str, c: Completion) -> bool:
        return bool(delta) or c.finish_reason is not None  # the text chunk, else the finishing one

    def stream_events(self, index: int, first: bool, delta: str, c: Completion, new: slice | None,
                      prompt: list[int]) -> list[dict]:
        logprobs = None
        if self.returns.logprobs and new is not None and c.output_ids[new]:
            logprobs = self.render.chat(c.output_ids[new], c.logprobs[new])

        def event(delta: dict, finish: str | None = None, stop=None, logprobs=None) -> dict:
            return {"index": index, "delta": {"reasoning_content": None, **delta}, "logprobs": logprobs,
                    "finish_reason": finish, "matched_stop": stop}

        events = [event({"role": "assistant", "content": ""})] if first else []
        if delta:
            events.append(event({"content": delta}, logprobs=logprobs))
            logprobs = None
        if c.finish_reason is not None:  # with the log-probs of tokens that brought no text, if any
            events.append(event({}, c.finish_reason, matched(c), logprobs))
        return events
