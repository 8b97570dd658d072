"""What a workflow does when its environment fails (``rollout.on_env_error``).

A failure is an exception or an ``EnvTimeout`` out of an ``Env``'s constructor, ``reset`` or
``step``, or out of an agent's ``run(item, client)`` (except after a call refused for a limit).
``raise`` (the default) fails the worker with it. ``zero`` marks the episode
(``EpisodeStats.env_error``), prints the failure and lets the workflow end the episode there with
reward 0; the trainer keeps the episode in its group but trains none of its tokens, and its
return enters no statistics (``trainer/plan.py``). What the environment *returns* is not a failure but a contract: a reward that
is no finite number, a malformed observation or one with an id outside the vocabulary
(``observations.py``) fails the worker under either setting. Printing (``Throttle``): the first
failure of a worker, then at most one per ``every_s`` seconds (each says how many there were so
far); all of them are counted in ``rollout/env_errors``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from areal_async.rollout.env_limit import EnvTimeout

OnEnvError = Literal["raise", "zero"]


class EnvFailed(Exception):
    """An environment call failed and the episode ends there (``on_env_error: zero``)."""


class Throttle:
    """Says when to print: the first time, then at most once per ``every_s`` seconds; ``count``:
    the calls so far.

    Args:
        every_s: seconds between prints after the first; clock: monotonic seconds (a test's stand-in).
    """

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.every_s, self._clock = every_s, clock
        self.count = 0
        self._next: float | None = None

    def due(self) -> bool:
        """Count one occurrence; whether to print it."""
        self.count += 1
        now = self._clock()
        if self._next is not None and now < self._next:
            return False
        self._next = now + self.every_s
        return True


class EnvErrors:
    """One workflow's handling of its environment's failures.

    Args:
        on_env_error: ``raise`` | ``zero`` (``rollout.on_env_error``).
        every_s: at most one failure printed per this many seconds, after the first.
        clock: monotonic seconds (a test's stand-in).
    """

    def __init__(self, on_env_error: OnEnvError = "raise", every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if on_env_error not in ("raise", "zero"):
            raise ValueError(f"on_env_error={on_env_error!r} must be 'raise' or 'zero' (rollout.on_env_error)")
        self.on_env_error, self.every_s = on_env_error, every_s
        self._throttle = Throttle(every_s, clock)

    @property
    def count(self) -> int:
        """Failures handled so far under ``zero``."""
        return self._throttle.count

    def fail(self, exc: Exception, what: str, where: str, stats: dict) -> None:
        """Handle ``exc`` out of ``what`` (``Class.method``) in ``where`` (the episode and turn).

        Raises:
            EnvTimeout: ``exc`` itself, under ``raise``.
            RuntimeError: naming ``what``, ``where`` and ``exc``, under ``raise``.
            EnvFailed: under ``zero``, once ``stats["env_error"]`` is set and the failure counted.
        """
        if self.on_env_error == "raise":
            if isinstance(exc, EnvTimeout):
                raise exc
            raise RuntimeError(f"{what} raised in {where}: {exc!r}; fix it, or set rollout.on_env_error=zero "
                               f"to end such episodes with reward 0") from exc
        stats["env_error"] = True
        if self._throttle.due():
            print(f"[env] {what} failed in {where}: {exc!r}; the episode ends there with reward 0 "
                  f"(rollout.on_env_error=zero); {self.count} so far in this worker, all counted in "
                  f"rollout/env_errors, at most one printed per {self.every_s:g} s", flush=True)
        raise EnvFailed(f"{what} failed in {where}") from exc
