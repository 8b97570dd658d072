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

from ..token_logprobs import LogprobRenderer
from .engine.engine import Completion


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
