"""The continuous-batching scheduler of the embedded engine.

One asyncio task (``Engine.run``) owns all scheduling state; forward passes run on a single
executor thread (torch releases the GIL), so the HTTP server stays responsive. Each iteration:

1. drop finished / aborted requests and close the holes in the KV slots (the last running request
   moves into each hole, so running requests always occupy slots ``0..B-1``);
2. admit waiting requests into free slots, up to ``max_prefill_tokens`` prompt tokens;
3. one executor call: slot moves, prefill of the admitted requests, one decode step of the others,
   sampling of one token per request;
4. append the tokens, finish requests on a stop token or on ``max_new_tokens``.

Requests join and leave between steps. Weight swaps, pause and abort also happen between steps:
the step holds ``_step_lock``; a weight update takes it before copying tensors in. The decode batch
is whatever is running, so a request's logits can differ from its solo run in the last bits (the
matmul blocking depends on B) unless the forward is batch-invariant (``BatchedForward(...,
batch_invariant=True)``, deterministic mode); its sampling noise never does (see ``sampling.py``).
``jitter`` (tests only) sleeps a random delay before each step, so which requests share a step
changes from run to run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import secrets
from typing import Callable

import torch

from ..jitter import Jitter
from .forward import BatchedForward
from .sampling import SamplingParams, sample


@dataclasses.dataclass
class Completion:
    """What a finished request returns (``finish_reason``: ``stop`` | ``length`` | ``abort``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched: int | None
    prompt_tokens: int
    weight_version: int


@dataclasses.dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    done: asyncio.Future
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the slot

    @property
    def finished(self) -> bool:
        return self.done.done()


@dataclasses.dataclass
class _Plan:
    moves: list[tuple[int, int, int]]
    prefill: list[_Request]
    decode: list[_Request]  # ordered by slot, slots 0..len-1


class Engine:
    """Continuous batching over ``BatchedForward``.

    Args:
        forward: the model's batched forward (owns the KV cache).
        eos_token_ids: the model's end-of-sequence ids (stop unless ``ignore_eos``).
        max_prefill_tokens: prompt tokens admitted per step (at least one request is always admitted).
        weight_version: initial policy version.
        jitter: random delay before each step (``debug.jitter_ms``); ``None``: none.
    """

    def __init__(
        self,
        forward: BatchedForward,
        eos_token_ids: set[int],
        max_prefill_tokens: int = 4096,
        weight_version: int = 0,
        jitter: Jitter | None = None,
    ):
        self.forward = forward
        self._jitter = jitter
        self.max_running = forward.cache.num_slots
        self.max_seq_len = forward.cache.max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.vocab_size = forward.embed.weight.shape[0]
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._paused = False
        self._error: RuntimeError | None = None
        self._step_waiters: list[asyncio.Future] = []
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forward")

    # ---- requests -------------------------------------------------------------------------------

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` (naming the limit) for a request this engine cannot run."""
        if not input_ids:
            raise ValueError("input_ids is empty; send at least one prompt token")
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids has {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
        total = len(input_ids) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the server's max_seq_len {self.max_seq_len}; shorten one or raise --max-seq-len"
            )

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str) -> Completion:
        """Queue a request and wait for it to finish (or be aborted). Raises ``ValueError`` on bad input."""
        self.validate(input_ids, params)
        if self._error is not None:
            raise self._error
        seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        req = _Request(rid, list(input_ids), params, seed, frozenset(stop),
                       asyncio.get_running_loop().create_future())
        self._waiting.append(req)
        self._wake.set()
        return await req.done

    def _finish(self, req: _Request, reason: str, matched: int | None = None) -> None:
        if not req.finished:
            req.done.set_result(Completion(list(req.output_ids), list(req.logprobs), reason, matched,
                                           len(req.input_ids), self.weight_version))

    def abort(self, rid: str | None = None) -> int:
        """Abort request ``rid`` (or all when ``None``): it returns at once with its partial output."""
        hits = [r for r in [*self._running, *self._waiting] if rid is None or r.rid == rid]
        for req in hits:
            self._finish(req, "abort")
        self._wake.set()
        return len(hits)

    async def next_step(self) -> None:
        """Return after the next decode/prefill step has been committed (for tests and probes)."""
        waiter = asyncio.get_running_loop().create_future()
        self._step_waiters.append(waiter)
        await waiter

    @property
    def num_running(self) -> int:
        return sum(not r.finished for r in self._running)

    # ---- flow control and weights ---------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: every queued or running request returns now with its partial
        output; ``in_place``: running requests keep their slots and resume on ``resume``. Requests
        arriving while paused wait. Returns once no step is in flight."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode '{mode}' is not supported; use 'abort' or 'in_place'")
        self._paused = True
        if mode == "abort":
            self.abort(None)
        async with self._step_lock:
            pass

    def resume(self) -> None:
        self._paused = False
        self._error: RuntimeError | None = None
        self._step_waiters: list[asyncio.Future] = []
        self._wake.set()

    async def update_weights(self, receive: Callable[[], dict[str, torch.Tensor]], version: int) -> None:
        """Run ``receive`` (blocking: disk read or broadcast) off the loop, then swap the tensors in
        between two decode steps and set ``weight_version``. Raises what ``receive`` / the load raise."""
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(None, receive)
        async with self._step_lock:
            await loop.run_in_executor(self._pool, self.forward.load_weights, tensors)
            self.weight_version = version

    async def run_blocking(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the default executor (for calls that block, e.g. joining a group)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Schedule forever (cancel to stop). One iteration = one executor step."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._jitter is not None and (self._waiting or self._running):
                    await self._jitter()  # injected timing noise: changes who shares the next step
                plan = self._plan()
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._step_lock:
                    tokens, logprobs = await loop.run_in_executor(self._pool, self._step, plan)
                self._commit(plan, tokens, logprobs)
        except Exception as exc:  # a dead engine must not leave callers waiting forever
            self._error = RuntimeError(f"inference engine failed: {type(exc).__name__}: {exc}")
            for req in [*self._running, *self._waiting]:
                if not req.finished:
                    req.done.set_exception(self._error)
            raise
        finally:
            self._pool.shutdown(wait=True)

    def _plan(self) -> _Plan | None:
        """Compact slots and admit waiting requests; ``None`` when there is nothing to run."""
        alive = [r for r in self._running if not r.finished]
        if self._paused:  # in-place pause keeps the running requests (and their slots) as they are
            self._running = alive
            return None
        n = len(alive)
        taken = {r.slot for r in alive if r.slot < n}
        holes = [s for s in range(n) if s not in taken]
        moves = []
        for req, dst in zip([r for r in alive if r.slot >= n], holes):
            moves.append((req.slot, dst, req.cached))
            req.slot = dst
        alive.sort(key=lambda r: r.slot)
        prefill, budget = [], self.max_prefill_tokens
        while self._waiting and n + len(prefill) < self.max_running:
            req = self._waiting[0]
            if req.finished:
                self._waiting.popleft()
                continue
            if prefill and len(req.input_ids) > budget:
                break
            self._waiting.popleft()
            budget -= len(req.input_ids)
            req.slot = n + len(prefill)
            prefill.append(req)
        self._running = alive + prefill
        if not self._running:
            return None
        return _Plan(moves, prefill, alive)

    def _step(self, plan: _Plan) -> tuple[list[int], list[float]]:
        """Executor side: slot moves, forward passes, sampling. Touches no scheduling state."""
        for src, dst, length in plan.moves:
            self.forward.cache.move(src, dst, length)
        logits = []
        if plan.decode:
            logits.append(self.forward.decode_batch([r.output_ids[-1] for r in plan.decode],
                                                    [r.cached for r in plan.decode]))
        if plan.prefill:
            logits.append(self.forward.prefill([r.input_ids for r in plan.prefill], [r.slot for r in plan.prefill]))
        reqs = plan.decode + plan.prefill
        device = self.forward.device
        with torch.inference_mode():
            tokens, logprobs = sample(
                torch.cat(logits) if len(logits) > 1 else logits[0],
                temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32),
                top_p=torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32),
                top_k=torch.tensor([r.params.top_k for r in reqs], dtype=torch.int64),
                seeds=[r.seed for r in reqs],
                positions=[len(r.input_ids) + len(r.output_ids) for r in reqs],
            )
        return tokens.tolist(), logprobs.tolist()

    def _commit(self, plan: _Plan, tokens: list[int], logprobs: list[float]) -> None:
        for req in plan.prefill:
            req.cached = len(req.input_ids)
        for req in plan.decode:
            req.cached += 1
        for req, token, logprob in zip(plan.decode + plan.prefill, tokens, logprobs):
            if req.finished:  # aborted while the step ran: its partial output was already returned
                continue
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            if token in req.stop_ids:
                self._finish(req, "stop", token)
            elif len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(req, "length")
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
