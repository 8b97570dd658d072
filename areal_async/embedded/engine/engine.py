"""The embedded engine: continuous batching over ``BatchedForward``, one step in flight while the
host works.

``Engine`` takes requests (``generate``, ``abort``, ``prompt_logprobs``), queues them and runs the
loop (``run``). One asyncio task owns every piece of scheduling state; forward passes run on one
executor thread (torch releases the GIL), so the HTTP server stays responsive. What one iteration
of the loop does (plan, launch, commit, pipelined one deep) is ``step.py``; pause, continue and
weight updates, which need a quiet engine, are ``flow_control.py``; a request's state, progress
sink and result are ``requests.py``.

Invariants: every queued request is finished exactly once (stop, length, abort) or raises; aborts
(``abort``, or a cancelled ``generate`` caller) return at once with the tokens committed so far.
**Admission** (``admission.py``): at most ``max_queued_requests`` requests wait for a slot beyond
the slots free now; one more is refused at ``generate`` with ``QueueFull`` (HTTP 503 on the
server), never queued. **Death**: an exception in the loop (a device fault) kills it for good
(``run``): every unfinished request and ``next_step`` waiter raises ``EngineFailed``, and so does
every later ``generate``, ``check_room``, ``pause`` or update; ``failure`` says why
(``continue_generation`` restarts nothing). ``jitter`` (tests only) sleeps a random delay before
each plan, so which requests share a step changes from run to run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import secrets

import numpy as np
import torch

from ...jitter import Jitter
from .admission import QueueFull
from .flow_control import FlowControl
from .forward import BatchedForward
from .prefix_cache import PrefixCache
from .requests import Completion, EngineFailed, Request, TokenSink
from .sampling import SamplingParams
from .step import Plan, StepCommitted, StepPipeline
from .stop import StopStrings


class Engine(StepPipeline, FlowControl):
    """Continuous batching over ``BatchedForward``, one step in flight while the host works.

    Args:
        forward: the model's batched forward (owns the KV cache).
        eos_token_ids: the model's end-of-sequence ids (stop unless ``ignore_eos``).
        max_prefill_tokens: prompt tokens computed per step (copied ones do not count; at least one
            request is always admitted).
        weight_version: initial policy version.
        jitter: random delay before each plan (``debug.jitter_ms``); ``None``: none.
        prefix_cache: reuse prompts' keys and values (``StepPipeline._admit``, ``step.py``);
            ``False``: every prompt is computed in full (SGLang's ``--disable-radix-cache``).
        tokenizer: the HF tokenizer stop strings are matched with (``stop.py``); ``None``: requests
            with stop strings are refused.
        max_queued_requests: requests that may wait for a KV slot beyond the free ones
            (``admission.py``); one more is refused with ``QueueFull``; ``None``: no bound.

    Raises:
        ValueError: ``max_queued_requests < 1``.
    """

    def __init__(
        self,
        forward: BatchedForward,
        eos_token_ids: set[int],
        max_prefill_tokens: int = 4096,
        weight_version: int = 0,
        jitter: Jitter | None = None,
        prefix_cache: bool = True,
        tokenizer=None,
        max_queued_requests: int | None = None,
    ):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests {max_queued_requests}: must be >= 1 (requests waiting for a "
                             f"KV slot), or None for no bound")
        self.max_queued = max_queued_requests
        self.forward = forward
        self.tokenizer = tokenizer
        # one prompt in several requests of a step is computed once: exact in every mode (a
        # prefill row's result depends only on its own prompt in batch-invariant mode)
        self.share_prompts = prefix_cache
        # a cached prefix changes the prefill's shapes, so in batch-invariant mode a result would
        # depend on what happened to be cached: there, no reuse across steps or across prompts
        rows = forward.cache.prefix_rows
        self.prefix = PrefixCache(rows) if prefix_cache and rows and not forward.batch_invariant else None
        self._clock = 0  # plans made so far: the prefix cache's clock
        self._saves: list[tuple[int, int, int]] = []  # leaving requests' (slot, prefix row, positions), not yet launched
        # prompt tokens of admitted requests, and those of them copied instead of computed (the hit rate)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self._jitter = jitter
        self.max_running = forward.cache.num_slots
        self.max_seq_len = forward.cache.max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.adapter = None  # the LoRA adapter merged into the weights (embedded/lora.py), if one
        self.vocab_size = forward.embed.weight.shape[0]
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # hold slots 0..len-1 and are decoded again
        # arrived while an unpaused update waits for the requests before it: queued after its swap
        self._held: list[Request] = []
        self._updates_waiting = 0  # unpaused updates that hold new requests back
        self._in_flight: Plan | None = None  # launched, not yet committed
        self._paused = False
        self._error: EngineFailed | None = None
        self._step_waiters: list[asyncio.Future] = []
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._drain_requests = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.cpu_share = None  # cpu_threads: adaptive: this server's slot (areal_async/cpu_share.py), set by the server
        # each slot's last sampled token, on the device (entry max_slots: the scratch slot's)
        self._slot_tokens = torch.zeros(self.max_running + 1, dtype=torch.int64, device=forward.device)
        # each slot's sampling parameters on the host, kept in step with the slots: a step passes
        # slices instead of building tensors from per-request lists
        self._slot_temperature = np.zeros(self.max_running, dtype=np.float32)
        self._slot_top_p = np.ones(self.max_running, dtype=np.float32)
        self._slot_top_k = np.full(self.max_running, -1, dtype=np.int64)
        self._slot_seed = [0] * self.max_running

    # ---- requests -------------------------------------------------------------------------------

    def validate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> None:
        """Raise ``ValueError`` (naming the limit) for a request this engine cannot run, or whose
        ``rid`` an unfinished request already holds (``abort`` by rid would stop both)."""
        if rid is not None and any(r.rid == rid for r in self._unfinished()):
            raise ValueError(f"rid {rid!r} is already running in another request; give each request its "
                             f"own id, or wait for (or abort) the one running")
        if not input_ids:
            raise ValueError("input_ids is empty; send at least one prompt token")
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids has {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params.stop {list(params.stop)!r} needs a tokenizer to match the text, and "
                             f"this engine has none; send stop_token_ids instead")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids has {bad[0]!r}, outside the vocabulary "
                             f"[0, {self.vocab_size}); send ids of this model's tokenizer")
        total = len(input_ids) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the server's max_seq_len {self.max_seq_len}; shorten one or raise --max-seq-len"
            )

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str,
                       sink: TokenSink | None = None, bounded: bool = True) -> Completion:
        """Queue a request and wait for it to finish (or be aborted). Raises ``ValueError`` on bad
        input or a ``rid`` already running (``validate``), ``QueueFull`` when ``bounded`` and
        ``max_queued_requests`` requests already wait (``check_room``; ``bounded=False``: a
        health probe, queued whatever waits), ``EngineFailed`` when the engine is dead or dies
        before the request finishes. Cancelling the caller (e.g. its HTTP client went
        away) aborts the request, so its slot is free at the next step. ``sink``, if given, is told
        of the request's admission, of each token as it is committed, and of its end."""
        self.validate(input_ids, params, rid)
        if self._error is not None:
            raise self._error
        if params.max_new_tokens == 0:  # prefill only (SGLang's select / cache_prefix): no token drawn
            return Completion([], [], "length", None, len(input_ids), self.weight_version)
        if bounded:
            self.check_room()  # no await between this check and the append below: the bound holds
        future = asyncio.get_running_loop().create_future()
        seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
        # SGLang's token-based finish: stop_token_ids and EOS alike, and neither with ignore_eos;
        # min_new_tokens keeps both from being drawn (its penalizer), whatever ignore_eos says
        stop_ids = set(params.stop_token_ids) | set(self.eos_token_ids)
        req = Request(rid, list(input_ids), params, seed, frozenset() if params.ignore_eos else frozenset(stop_ids),
                       future, StopStrings(params.stop, self.tokenizer) if params.stop else None,
                       sorted(stop_ids) if params.min_new_tokens else [], sink)
        # an update waiting for the requests before it goes first (SGLang's lock prefers writers)
        (self._held if self._updates_waiting else self._waiting).append(req)
        self._wake.set()
        try:
            return await asyncio.shield(req.done)  # shielded: a cancelled caller finishes it as an abort
        except asyncio.CancelledError:
            self._finish(req, "abort")
            self._wake.set()
            raise

    async def prompt_logprobs(self, input_ids: list[int], start: int) -> list[float | None]:
        """SGLang's ``input_token_logprobs`` values of a prompt from position ``start``: entry j is
        ``log_softmax(logits)`` (temperature 1, as SGLang's) of prompt token ``start + j`` given the
        tokens before it, except entry 0, which SGLang leaves ``None`` whatever ``start`` is
        (``logprob_result_processor``: ``[None] + logprobs[:-1]``). ``len(input_ids) - start``
        entries, from one forward of the model's own (HF) module on the forward thread, between
        steps, under the weights in service then.

        Raises:
            ValueError: ``start`` outside ``[0, len(input_ids))``.
        """
        if self._error is not None:  # its forward thread is gone with its loop
            raise self._error
        if not 0 <= start < len(input_ids):
            raise ValueError(f"logprob_start_len {start} is not in [0, {len(input_ids)}) for a prompt of "
                             f"{len(input_ids)} tokens; send -1 (output tokens only) or a prompt position")

        @torch.inference_mode()
        def forward() -> list[float]:
            ids = torch.tensor([input_ids], device=self.forward.device)
            logits = self.forward.model(ids).logits[0, start:-1].float()
            return torch.log_softmax(logits, -1).gather(-1, ids[0, start + 1:, None]).squeeze(-1).tolist()

        return [None, *await asyncio.get_running_loop().run_in_executor(self._pool, forward)]

    def _finish(self, req: Request, reason: str, matched: int | str | None = None) -> None:
        if not req.finished:
            req.done.set_result(Completion(list(req.output_ids), list(req.logprobs), reason, matched,
                                           len(req.input_ids), self.weight_version, req.cached_tokens))
            if req.sink is not None:
                req.sink.finished(req.done.result())

    def check_room(self, asked: int = 1) -> None:
        """Raise ``QueueFull`` unless ``asked`` more requests fit: at most ``max_queued_requests``
        may wait beyond the KV slots free now (``admission.py``); running requests do not count.
        A dead engine takes none: ``EngineFailed``."""
        if self._error is not None:
            raise self._error
        if self.max_queued is None:
            return
        # free slots take waiting requests at the next step: a burst into an idle engine fills them
        # before it queues (slots of requests finished since the last step count as taken)
        limit = self.max_queued + max(0, self.max_running - len(self._running))
        if len(self._waiting) + len(self._held) + asked > limit:
            # aborted requests stay in the deques until the scheduler reaches them: drop them
            # first, so requests whose clients left never refuse new ones (no await: _admit, the
            # only other reader, runs on this loop between awaits)
            self._waiting = collections.deque(r for r in self._waiting if not r.finished)
            self._held = [r for r in self._held if not r.finished]
        waiting = len(self._waiting) + len(self._held)
        if waiting + asked > limit:
            raise QueueFull(waiting, self.max_queued, asked, limit - self.max_queued)

    @property
    def failure(self) -> EngineFailed | None:
        """Why the engine's loop died (``run``), or ``None`` while it lives."""
        return self._error

    @property
    def paused(self) -> bool:
        """Generation is paused (``pause``, until ``continue_generation``)."""
        return self._paused

    @property
    def holding(self) -> bool:
        """Generation is held on purpose: paused (``pause``) or a weight update waits (``update_weights``
        without a pause), so no step may come for a while."""
        return self._paused or self._updates_waiting > 0

    @property
    def num_waiting(self) -> int:
        """Unfinished requests waiting for a KV slot (queued, or held for a weight update)."""
        return sum(not r.finished for r in (*self._waiting, *self._held))

    def _unfinished(self, held: bool = True) -> list[Request]:
        """Every request not yet finished: waiting, running, or with its last token in flight, and
        (``held``) those held back by a waiting update."""
        seen = [*self._running, *(self._in_flight.rows if self._in_flight else []), *self._waiting,
                *(self._held if held else [])]
        return [r for r in dict.fromkeys(seen) if not r.finished]

    def abort(self, rid: str | None = None) -> int:
        """Abort request ``rid`` (or all when ``None``): it returns at once with its committed
        output (a token still in flight is dropped). Returns how many requests were aborted."""
        hits = [r for r in self._unfinished() if rid is None or r.rid == rid]
        for req in hits:
            self._finish(req, "abort")
        self._wake.set()
        return len(hits)

    async def next_step(self) -> StepCommitted:
        """Return after the next decode/prefill step has been committed (for tests and probes), with
        its weight version and whether its log-probs are finite. Raises ``EngineFailed`` when the
        engine is dead or dies first."""
        if self._error is not None:
            raise self._error
        waiter = asyncio.get_running_loop().create_future()
        self._step_waiters.append(waiter)
        return await waiter

    @property
    def num_running(self) -> int:
        """Unfinished requests that hold a KV slot (decoding, or with their last token in flight)."""
        return sum(r.slot >= 0 for r in self._unfinished())

    # ---- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Schedule forever (cancel to stop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._drain_requests:  # a drain waiting for the lock goes first
                    async with self._step_lock:
                        if self.cpu_share is not None:
                            self.cpu_share.busy()  # cpu_threads: adaptive; each step refreshes its threads
                        try:
                            await self._pipeline(loop)
                        finally:
                            if self.cpu_share is not None:
                                self.cpu_share.idle()
                # no await since the pipeline last looked for work or a drain: no wake-up is lost
                self._wake.clear()
                await self._wake.wait()
        except Exception as exc:  # a dead engine must not leave callers waiting forever
            self._error = EngineFailed(f"inference engine failed: {type(exc).__name__}: {exc}; it runs no more "
                                       f"steps: restart the server")
            for waiter in [*(r.done for r in self._unfinished()), *self._step_waiters]:
                if not waiter.done():
                    waiter.set_exception(self._error)
            raise
        finally:
            self._pool.shutdown(wait=True)

    async def _pipeline(self, loop: asyncio.AbstractEventLoop) -> None:
        """Launch steps back to back, committing each while the next runs, until there is nothing to
        run, the engine is paused, or a drain is requested; returns with no step in flight."""
        while True:
            plan = None
            if not self._drain_requests:
                if self._jitter is not None and (self._waiting or self._running):
                    await self._jitter()  # injected timing noise: changes who shares the next step
                if not self._drain_requests:  # may have been raised during the jitter
                    plan = self._plan()
            if plan is None and self._in_flight is None:
                return
            done = self._in_flight
            results = await loop.run_in_executor(self._pool, self._advance, plan, done)
            self._in_flight = plan
            if done is not None:
                self._commit(done, *results)
