"""Admission of generation requests: the bound on requests waiting for a KV slot, and its HTTP 503.

At most ``max_queued_requests`` requests wait beyond the KV slots free now (a batch counts whole);
one more raises ``QueueFull``, answered with HTTP 503 and ``retry_after_headers()``. How the server
applies it: docs/engine.md ("Admission"); how SGLang counts: docs/sglang_api.md#generation.
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
