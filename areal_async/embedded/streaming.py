"""Running a response's requests with their progress streamed: what SGLang's ``stream: true`` needs.

``run_requests`` queues one engine request per prompt (prompts x ``n`` for OpenAI) and calls
``emit(index, completion)`` with snapshots (``finish_reason`` ``None``) by SGLang's
``--stream-interval`` rule (docs/sglang_api.md, "Streaming") and once with each final completion
(only then, with ``interval=None``). Tokens are pushed to it (``_Progress``, an ``engine.TokenSink``),
never polled. Cancelling it, or an ``emit`` that raises, aborts every request, freeing their KV
slots; a log-prob that is not finite raises ``NonFiniteLogprobs``.
"""

from __future__ import annotations

import asyncio
import math
from typing import Awaitable, Callable

import msgspec
from aiohttp import web

from .engine.engine import Engine
from .engine.requests import Completion
from .engine.sampling import SamplingParams
from .engine.stop import hold_back

Emit = Callable[[int, Completion], Awaitable[None]]


class NonFiniteLogprobs(RuntimeError):
    """A request of the response produced a log-prob that is NaN or inf; the message says which."""


def non_finite(done: list[Completion], rids: list[str]) -> str | None:
    """The error message for completions with a non-finite log-prob (NaN or inf: the weights in
    service are broken), naming the first one's rid and weight version; ``None`` when all are
    finite. JSON has no NaN, and tokens drawn from such logits are noise."""
    bad = [(rid, c) for c, rid in zip(done, rids) if not all(map(math.isfinite, c.logprobs))]
    if not bad:
        return None
    (rid, c), more = bad[0], f" (and {len(bad) - 1} more of the batch)" if len(bad) > 1 else ""
    return (f"the model produced non-finite log-probs (NaN or inf) for rid {rid!r}{more} under weight "
            f"version {c.weight_version}: those weights are broken (e.g. a diverged training step); "
            f"load good weights, e.g. a version from before the divergence")


def running_text(text: str, params: SamplingParams) -> str:
    """The decoded output of a running request as a stream shows it, so that it is a prefix of the
    finished text: less a trailing U+FFFD (the bytes of an incomplete UTF-8 character so far) and,
    unless ``no_stop_trim``, less a tail that begins a stop string (``stop.hold_back``: the answer
    cuts it if the stop string completes; a later chunk sends it if it does not)."""
    text = text.rstrip("\ufffd")
    return text if params.no_stop_trim else hold_back(text, params.stop)


SSE_DONE = b"data: [DONE]\n\n"  # a stream's last event, as SGLang and OpenAI end one


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Send the headers of a server-sent-event stream (HTTP 200, ``text/event-stream``)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def sse_event(payload) -> bytes:
    """One server-sent event, ``data: <JSON>`` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def sse_error(message: str, status: int) -> bytes:
    """The event of an error once a stream has begun (SGLang's ``/generate`` stream shape)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    # 503: the waiting queue was full (admission.py), the same call may succeed later
    return sse_event({"error": {"message": message, "type": kind, "code": status, "retryable": status == 503}})


class _Progress:
    """One request's progress (an ``engine.TokenSink``): its committed tokens, then its final
    ``Completion``; sets ``changed`` on each."""

    def __init__(self, changed: asyncio.Event, prompt_tokens: int):
        self.changed, self.prompt_tokens = changed, prompt_tokens
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.cached_tokens = 0
        self.sent = 0  # tokens in the last chunk emitted
        self.final: Completion | None = None

    def admitted(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens

    def token(self, token_id: int, logprob: float) -> None:
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)
        self.changed.set()

    def finished(self, completion: Completion) -> None:
        self.final = completion
        self.changed.set()

    def snapshot(self, weight_version: int) -> Completion:
        return Completion(list(self.output_ids), list(self.logprobs), None, None, self.prompt_tokens,
                          weight_version, self.cached_tokens)

    def due(self, interval: int) -> bool:
        """Whether a running request's progress is to be emitted now (SGLang's stream interval)."""
        unsent = len(self.output_ids) - self.sent
        return unsent > 0 and (interval == 1 or unsent >= interval or self.sent == 0)


async def run_requests(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
                       interval: int | None, emit: Emit) -> list[Completion]:
    """Run ``prompts[i]`` with ``params[i]`` as request ``rids[i]``, calling ``emit`` as the module
    docstring says; returns the final completions, in prompt order.

    Raises:
        ValueError: a request the engine refuses (e.g. its rid was taken since it was validated).
        NonFiniteLogprobs: a request produced a NaN or inf log-prob; the others are aborted.
        EngineFailed: the engine died.
        Whatever ``emit`` raises (the others are aborted).
    """
    if interval is not None and interval < 1:
        raise ValueError(f"stream interval {interval}: must be >= 1 (tokens per streamed chunk)")
    changed = asyncio.Event()
    progress = [_Progress(changed, len(p)) for p in prompts]
    try:
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(engine.generate(p, sp, rid, sink))
                       for p, sp, rid, sink in zip(prompts, params, rids, progress)]
            for task in running:  # a request that fails (engine error, refused) ends without a final
                task.add_done_callback(lambda _: changed.set())
            pending = set(range(len(prompts)))
            while pending:
                await changed.wait()  # a token was committed, or a request finished or failed
                changed.clear()
                for i in sorted(pending):
                    p = progress[i]
                    if p.final is not None:
                        pending.discard(i)
                        await _emit_checked(emit, i, p.final, rids[i])
                    elif running[i].done():
                        done = running[i].result()  # raises its error (the task group then aborts the rest)
                        if done.finish_reason is None:
                            raise AssertionError(f"request {rids[i]} returned without finishing")
                        pending.discard(i)  # finished without the scheduler: a prefill-only request
                        await _emit_checked(emit, i, done, rids[i])
                    elif interval is not None and p.due(interval):
                        p.sent = len(p.output_ids)
                        await _emit_checked(emit, i, p.snapshot(engine.weight_version), rids[i])
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first failure, as a single request raises it
    return [task.result() for task in running]


async def _emit_checked(emit: Emit, index: int, completion: Completion, rid: str) -> None:
    broken = non_finite([completion], [rid])
    if broken:
        raise NonFiniteLogprobs(broken)
    await emit(index, completion)
