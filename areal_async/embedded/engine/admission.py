"""Admission of generation requests: the bound on requests waiting for a KV slot, and its HTTP 503.

The engine decodes at most ``max_running_requests`` requests at once (one KV slot each); the
others wait in its queue. ``max_queued_requests`` bounds that queue, as SGLang's
``--max-queued-requests`` does: a request arriving when it is full is refused at once instead of
waiting behind it, so a flood of requests (a misconfigured rollout, 1,000 clients at once) is
answered within milliseconds, never by a connection that hangs or a server that runs out of memory.
Requests holding a KV slot are not counted, nor are as many waiting ones as there are free slots
(the next step admits them): a burst into an idle server gets ``max_running_requests +
max_queued_requests`` requests in. A prefill-only request (``max_new_tokens: 0``) never queues.

What SGLang 0.5.23 does (``Scheduler._abort_on_queued_limit``): the bound counts its waiting
queue only, free slots or not (a burst that arrives between two scheduler iterations is queued
before the next batch is formed, so it gets ``max_queued_requests`` in); the default is no bound;
a refused non-streamed ``/generate`` is HTTP 503 with ``{"object": "error", "message": "The
request queue is full.", "code": 503}`` and no ``Retry-After`` header; a refused streamed one is
an abort chunk in an HTTP 200 stream. Here a refusal is HTTP 503 with ``Retry-After:
RETRY_AFTER_S`` and this project's error body (its message starts with SGLang's sentence),
streamed or not: the bound is checked before a stream's headers are sent, and again when its
requests enter the queue (another call may have filled it meanwhile; the stream then ends with an
error event of code 503, ``retryable: true``). A batch (several prompts, or ``n`` choices) is
admitted whole or refused whole. The default bound is ``config.DEFAULT_MAX_QUEUED`` (not unbounded):
each waiting request holds its prompt as Python ints (~36 bytes a token) and an open connection.

``InferenceClient`` retries a 503 after its ``Retry-After`` (SGLang's, without the header, after
its own backoff), within a bounded time (``client.py``).
"""

from __future__ import annotations

# seconds a refused caller waits before it asks again: enough for decode steps to free slots,
# short against a generation (the header takes whole seconds; 1 is its smallest useful value)
RETRY_AFTER_S = 1


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: a new request is refused (HTTP 503).

    ``waiting``: requests waiting for a KV slot when it was refused; ``free``: KV slots free then;
    ``asked``: requests this call brought (a batch counts each prompt and choice).
    """

    def __init__(self, waiting: int, max_queued: int, asked: int = 1, free: int = 0):
        self.waiting, self.max_queued, self.asked, self.free = waiting, max_queued, asked, free
        super().__init__(
            f"The request queue is full. {waiting} request(s) wait for a KV slot ({free} free) and at most "
            f"{max_queued} may wait beyond the free slots (--max-queued-requests; this call brings {asked}); "
            f"retry after the Retry-After header's {RETRY_AFTER_S} s, or send fewer requests at once, or raise "
            f"--max-queued-requests / --max-running-requests")


def retry_after_headers() -> dict[str, str]:
    """The headers of a 503 refusal: ``Retry-After`` in whole seconds (RFC 9110's delay-seconds)."""
    return {"Retry-After": str(RETRY_AFTER_S)}
