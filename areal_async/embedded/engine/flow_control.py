"""Pause, continue and weight updates: the engine calls that need a quiet engine (no step in flight,
every launched step committed).

``FlowControl`` (mixed into ``Engine``). The pipeline holds ``_step_lock`` from its first launch until
it has committed its last step; ``_quiet`` raises ``_drain_requests`` (the pipeline then launches
nothing new, commits what is in flight and lets go) and takes the lock. So a request finished by the
steps before a swap reports the version that made its tokens (one paused in place across a swap
reports the new version, as on SGLang).

When a weight update swaps (``update_weights``, as SGLang 0.5.23's model-update lock orders it): at
once on a paused engine; otherwise after every request unfinished at the call has ended under the
old weights, while requests arriving meanwhile are held (``_held``) and run under the new ones.
Every swap flushes the prefix cache first (stale keys and values are never right; its entries are
also keyed by weight version, so none would match anyway), and a request that holds its slot across
a swap (paused in place) is never saved into it: its keys and values mix two weights. The request
queues and the loop are ``engine.py``; the step the pipeline runs is ``step.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

import torch

from ...weight_group import in_daemon_thread


class FlowControl:
    """``Engine``'s pause, continue, weight update and cache flush (module docstring). They use the
    engine's state, set up in ``Engine.__init__``: ``_step_lock``, ``_drain_requests``,
    ``_in_flight``, ``_paused``, ``_updates_waiting``, the queues (``_waiting``, ``_held``), the
    prefix cache and the forward thread (``_pool``)."""

    @contextlib.asynccontextmanager
    async def _quiet(self):
        """Hold the step lock with no step in flight and every launched step committed."""
        # the pipeline keeps the lock while steps are in flight: ask it to stop launching, so it
        # commits the step in flight and lets go; the loop does not restart it while this is raised
        self._drain_requests += 1
        try:
            async with self._step_lock:
                if self._error is not None:  # the pipeline died mid-flight: nothing is drained
                    raise self._error
                assert self._in_flight is None, "a step is in flight under the step lock"
                yield
        finally:
            self._drain_requests -= 1
            self._wake.set()

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: every queued or running request returns now with its partial
        output; ``in_place``: running requests keep their slots and go on at ``continue_generation``. Requests
        arriving while paused wait. Returns once no step is in flight and every launched step is
        committed."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode '{mode}' is not supported; use 'abort' or 'in_place'")
        self._paused = True
        if mode == "abort":
            self.abort(None)
        async with self._quiet():
            pass

    def continue_generation(self) -> None:
        """Go on after ``pause``: requests paused in place go on, those that arrived while paused
        start. ``next_step`` waiters registered while paused keep waiting: the next committed step
        releases them (or the engine's death fails them)."""
        self._paused = False
        self._wake.set()

    async def update_weights(self, receive: Callable[[], dict[str, torch.Tensor]], version: int,
                             load: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
        """Run ``receive`` (blocking: disk read or broadcast) off the loop while generation goes on,
        then drain the pipeline, swap the tensors in (``load`` on the forward thread; default
        ``forward.load_weights``; a LoRA adapter's merge: ``embedded/lora.py``) and set
        ``weight_version``. Raises what ``receive`` / the load raise. ``receive`` runs in a daemon thread: cancelled while it
        blocks (a broadcast whose sender is gone), the update is abandoned and the thread does not
        hold up the process's exit.

        When the swap happens, as on SGLang 0.5.23 (``tokenizer_control_mixin``: an update of a
        paused server skips the model-update lock, otherwise it takes it as a writer, and every
        ``/generate`` holds it as a reader until its response is out):

        - paused (``pause``, either mode): at once, between two steps; requests paused in place go
          on under the new weights at ``continue_generation``, so their tokens span versions;
        - not paused: after every request unfinished at this call (running or queued) has finished
          under the old weights; requests arriving meanwhile are held and queued after the swap,
          under the new weights (the lock prefers a waiting writer to new readers). Every request
          is then generated by one version; the update waits for the longest one in flight.
        """
        if self._paused:
            await self._swap(await in_daemon_thread(receive), version, load)
            return
        self._updates_waiting += 1
        receiving = in_daemon_thread(receive)
        try:
            before = [r.done for r in self._unfinished(held=False)]
            # a failed receive ends the wait at once; an engine that dies finishes the requests
            # with its error, which ends it too (and the swap raises it)
            await asyncio.wait([receiving, *before], return_when=asyncio.FIRST_EXCEPTION)
            await self._swap(await receiving, version, load)
        finally:
            receiving.cancel()  # a no-op once received; else (cancelled, failed) abandons the receive
            self._updates_waiting -= 1
            if not self._updates_waiting:
                self._waiting.extend(self._held)
                self._held.clear()
                self._wake.set()

    async def _swap(self, tensors: dict[str, torch.Tensor], version: int, load=None) -> None:
        """Drain the pipeline, load ``tensors`` (``load``, default ``forward.load_weights``) and set
        ``weight_version``."""
        async with self._quiet():
            # cached keys and values are the old weights' (nothing is planned until this is done)
            self.flush_cache()
            for req in self._running:  # paused in place: its slot's keys and values mix old and new weights
                req.kv_version = None
            await asyncio.get_running_loop().run_in_executor(self._pool, load or self.forward.load_weights, tensors)
            self.weight_version = version

    def flush_cache(self) -> None:
        """Forget every cached prefix (``/flush_cache``; weight updates do it themselves)."""
        if self.prefix is not None:
            self.prefix.clear()
        self._saves = []

