"""What the engine knows of one request: its state while queued or running (``Request``), who hears
of its progress (``TokenSink``: a streamed response), what it returns (``Completion``), and what it
raises once the engine's loop has died (``EngineFailed``).

Invariant: a ``Request`` is finished exactly when its ``done`` future is done; its ``output_ids``
and ``logprobs`` are its committed tokens, one log-prob each, never more than ``issued`` (tokens
launched for it, the step in flight included). ``engine.py`` queues requests and runs the loop;
``step.py`` admits them into KV slots and commits their tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from .sampling import SamplingParams
from .stop import StopStrings


@dataclasses.dataclass
class Completion:
    """What a finished request returns (``finish_reason``: ``stop`` | ``length`` | ``abort``; ``None``
    in a snapshot of a request still running, as a stream's intermediate chunk reports it;
    ``matched``: the stop token id or stop string of a ``stop``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    matched: int | str | None
    prompt_tokens: int
    weight_version: int
    cached_tokens: int = 0  # prompt tokens whose keys and values were copied, not computed


class EngineFailed(RuntimeError):
    """The engine's loop died (``Engine.run``): the message names the cause. Every unfinished
    request raises it, and so does every later call that needs the loop; nothing restarts it."""


class TokenSink(Protocol):
    """Receives one request's progress as the scheduler commits it (a streamed response).

    Its methods are called on the event loop, by the scheduler (admission, commit) or by an abort,
    so they must only record and signal (e.g. set an ``asyncio.Event``), never block or await. An
    engine that fails tells no sink: the request's ``generate`` raises instead.
    """

    def admitted(self, cached_tokens: int) -> None:
        """Called once, when the request takes a KV slot: ``cached_tokens`` prompt tokens were copied."""

    def token(self, token_id: int, logprob: float) -> None:
        """Called for each committed output token, in order (before the request finishes on it)."""

    def finished(self, completion: Completion) -> None:
        """Called once, when the request finishes (stop, length or abort), with what it returns."""


@dataclasses.dataclass(eq=False)
class Request:
    """One request, from ``Engine.generate`` until it finishes (module docstring's invariant)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    done: asyncio.Future
    stop_strings: StopStrings | None = None
    banned_ids: list[int] = dataclasses.field(default_factory=list)  # not drawn before min_new_tokens
    sink: TokenSink | None = None  # told of its admission, each committed token and its end
    output_ids: list[int] = dataclasses.field(default_factory=list)  # committed tokens
    logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int = -1
    issued: int = 0  # tokens sampled for it by launched steps, committed or still in flight
    cached_tokens: int = 0  # prompt positions copied into its slot instead of computed
    kv_version: int | None = None  # the weight version its slot's keys and values come from (None: mixed)

    @property
    def finished(self) -> bool:
        return self.done.done()

    @property
    def cached(self) -> int:
        """Positions whose K/V are in its slot once the launched steps have run (prompt + all
        issued tokens but the last, which is the next decode's input); for ``issued >= 1``."""
        return len(self.input_ids) + self.issued - 1

