"""The continuous-batching scheduler of the embedded engine, with host work overlapped on device work.

One asyncio task (``Engine.run``) owns all scheduling state; forward passes run on a single
executor thread (torch releases the GIL), so the HTTP server stays responsive. Steps are
pipelined one deep, as SGLang's overlap scheduler does: step n+1 is launched before step n's
tokens are read back, so while the device runs step n+1 the host commits step n and plans step
n+2. One iteration of the pipeline:

1. **plan** step n+1 (``_plan``): drop requests known to be finished and requests whose last
   token is already being sampled, close the holes in the KV slots (the last running request moves
   into each hole, so running requests always occupy slots ``0..B-1``), admit waiting requests into
   free slots, up to ``max_prefill_tokens`` prompt tokens;
2. **one executor call** (``_advance``): launch step n+1 (``_launch``: slot moves, prefill of the
   admitted requests, one decode step of the others, sampling of one token per request), then wait
   for step n's results and return them as host lists;
3. **commit** step n (``_commit``): append the tokens, finish requests in SGLang's order: on a stop
   string (``stop.py``; the token completing it is kept whole), on a stop token (EOS or
   ``stop_token_ids``; neither with ``ignore_eos``), or on ``max_new_tokens``. A request with
   ``max_new_tokens == 0`` (prefill only) returns at once with no token; its prompt's log-probs
   come from ``prompt_logprobs``. Until ``min_new_tokens`` tokens are out, a request's EOS and
   stop ids are banned from its draws (``sample``'s ``bans``; its log-probs stay unmasked).

Step n+1 needs step n's tokens as decode inputs before the host has seen them: every step writes
its sampled tokens on the device into ``_slot_tokens`` (``[max_slots + 1] int64``, one entry per KV
slot; a step's rows are its decode rows in slots ``0..n-1`` followed by its prefill rows in slots
``n..n+p-1``, so this is one slice copy), and decode reads its input tokens from there. Positions
stay host ints: a request's position is a function of how many tokens were issued for it
(``_Request.issued``, counting the step in flight), not of their values. Slot moves copy the
``_slot_tokens`` entry along with the KV, in stream order after the step in flight. Host tables
of each slot's temperature, top-p, top-k and seed are kept in step with the slots, so a step hands
``sample`` slices instead of tensors built from per-request lists. On CUDA the tokens and log-probs
go to pinned host memory with ``non_blocking`` copies and a recorded event; the wait in step 2 is
that event. On CPU every op is synchronous and the same code runs: the results are ready when the
launch returns, and nothing overlaps.

What the one-step lag costs: a request that samples a stop token at step n is still unknown to be
finished when step n+1 is planned, so it is decoded once more; that extra token is dropped at
commit and the slot is freed at the next plan (a waiting request may thus be admitted one step
later than without the pipeline). A request that has been issued ``max_new_tokens`` tokens is
never decoded again, so length-limited requests cost no extra step. Aborts (``abort``, or a
cancelled ``generate`` caller) return at once with the tokens committed so far (the in-flight token
is dropped). A streamed response passes ``generate`` a ``TokenSink``: the scheduler tells it of the
request's admission, of each token as step 3 commits it, and of the request's end.

Weight swaps and pause need a quiet engine: no step in flight and every launched step committed,
so a request finished by the steps before a swap reports the version that made its tokens (one
running across a swap reports the new version, as on SGLang). The pipeline holds
``_step_lock`` from its first launch until it has committed its last step; ``update_weights`` and
``pause`` first raise ``_drain_requests`` (the pipeline then launches nothing new, commits what is
in flight and releases the lock), then take the lock. The decode batch is whatever is running, so
a request's logits can differ from its solo run in the last bits (the matmul blocking depends on
B) unless the forward is batch-invariant (``BatchedForward(..., batch_invariant=True)``,
deterministic mode); its sampling noise never does (see ``sampling.py``). ``jitter`` (tests only)
sleeps a random delay before each plan, so which requests share a step changes from run to run.

**Prompt reuse** (``prefix_cache=True``, the default; ``_admit``). Anchors: SGLang's parallel
sampling, which prefills a prompt once for its ``n`` samples, and its radix cache. Two mechanisms:

- *twins*: requests admitted in one step with the same prompt (a group's samples) compute it
  once; the others get its keys and values by a slot copy after the forward and sample (each with
  its own seed) from the same logits row. A prefill row's result is a function of its own prompt
  in batch-invariant mode, so this is bitwise exact there, and it is on in every mode.
- *cached prefixes* (throughput mode only): every computed prompt is stored in a prefix cache
  row (``prefix_cache.py``); a later prompt copies the longest prefix it shares with an entry
  (capped one short of its length: the last prompt token always runs, for the logits) and
  computes only the rest. Within a step, prompts that share a prefix only with a prompt computed
  in the same step run in a second prefill forward after the first has filled the entry, so a
  step of 8 few-shot prompts computes the preamble once. The cache is flushed on every weight
  update (before the swap) and on ``flush_cache``.

Deterministic mode keeps only twins: a suffix attending to copied keys and values runs with other
shapes than a whole prompt (the attention's blocking), so its last bits, and so a sampled token,
could depend on whether the prefix happened to be cached, i.e. on timing. ``max_prefill_tokens``
counts computed tokens; copied ones are free.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import secrets
from typing import Callable, Protocol

import numpy as np
import torch

from ..jitter import Jitter
from ..weight_group import in_daemon_thread
from .forward import BatchedForward
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, sample
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
class _Request:
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

    @property
    def finished(self) -> bool:
        return self.done.done()

    @property
    def cached(self) -> int:
        """Positions whose K/V are in its slot once the launched steps have run (prompt + all
        issued tokens but the last, which is the next decode's input); for ``issued >= 1``."""
        return len(self.input_ids) + self.issued - 1


@dataclasses.dataclass(eq=False)
class _PrefillPass:
    """One prefill forward of a step: copy cached prefixes into the slots, run the rest of each
    prompt, then copy prompts into the prefix cache rows reserved for them."""

    copies: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (prefix row, slot, positions)
    requests: list[_Request] = dataclasses.field(default_factory=list)  # in slot order
    starts: list[int] = dataclasses.field(default_factory=list)  # positions each slot already holds
    inserts: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (slot, prefix row, positions)


@dataclasses.dataclass(eq=False)
class _Plan:
    """One step: decided by ``_plan`` (loop), launched by ``_launch`` (executor), committed by
    ``_commit`` (loop). Its rows are ``decode + prefill``, in slots ``0..len(rows)-1``."""

    moves: list[tuple[int, int, int]]  # (src slot, dst slot, positions to copy)
    prefill: list[_Request]
    decode: list[_Request]  # ordered by slot, slots 0..len-1
    positions: list[int]  # each decode row's input position
    sample_positions: list[int]  # each row's position of the token it draws
    # the prefill forwards (at most 2: the second reads prefixes the first stored), the copies of a
    # whole prompt into the slot of each later request of the step with the same prompt (after
    # the forwards), and each prefill request's row of the forwards' concatenated logits
    passes: list[_PrefillPass] = dataclasses.field(default_factory=list)
    twins: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (src slot, dst slot, positions)
    logit_rows: list[int] = dataclasses.field(default_factory=list)
    bans: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)  # (row, ids it cannot draw)
    tokens: torch.Tensor | None = None  # set by _launch: [rows] int64 on the host (pinned on CUDA)
    logprobs: torch.Tensor | None = None  # [rows] float32, same
    ready: torch.cuda.Event | None = None  # CUDA: fires when tokens / logprobs hold the results

    @property
    def rows(self) -> list[_Request]:
        return self.decode + self.prefill


class Engine:
    """Continuous batching over ``BatchedForward``, one step in flight while the host works.

    Args:
        forward: the model's batched forward (owns the KV cache).
        eos_token_ids: the model's end-of-sequence ids (stop unless ``ignore_eos``).
        max_prefill_tokens: prompt tokens computed per step (copied ones do not count; at least one
            request is always admitted).
        weight_version: initial policy version.
        jitter: random delay before each plan (``debug.jitter_ms``); ``None``: none.
        prefix_cache: reuse prompts' keys and values (see "Prompt reuse" in the module docstring);
            ``False``: every prompt is computed in full (SGLang's ``--disable-radix-cache``).
        tokenizer: the HF tokenizer stop strings are matched with (``stop.py``); ``None``: requests
            with stop strings are refused.
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
    ):
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
        self._jitter = jitter
        self.max_running = forward.cache.num_slots
        self.max_seq_len = forward.cache.max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.vocab_size = forward.embed.weight.shape[0]
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # hold slots 0..len-1 and are decoded again
        self._in_flight: _Plan | None = None  # launched, not yet committed
        self._paused = False
        self._error: RuntimeError | None = None
        self._step_waiters: list[asyncio.Future] = []
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._drain_requests = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forward")
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
                       sink: TokenSink | None = None) -> Completion:
        """Queue a request and wait for it to finish (or be aborted). Raises ``ValueError`` on bad
        input or a ``rid`` already running (``validate``). Cancelling the caller (e.g. its HTTP
        client went away) aborts the request, so its slot is free at the next step. ``sink``, if
        given, is told of the request's admission, of each token as it is committed, and of its end."""
        self.validate(input_ids, params, rid)
        if self._error is not None:
            raise self._error
        if params.max_new_tokens == 0:  # prefill only (SGLang's select / cache_prefix): no token drawn
            return Completion([], [], "length", None, len(input_ids), self.weight_version)
        future = asyncio.get_running_loop().create_future()
        seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
        # SGLang's token-based finish: stop_token_ids and EOS alike, and neither with ignore_eos;
        # min_new_tokens keeps both from being drawn (its penalizer), whatever ignore_eos says
        stop_ids = set(params.stop_token_ids) | set(self.eos_token_ids)
        req = _Request(rid, list(input_ids), params, seed, frozenset() if params.ignore_eos else frozenset(stop_ids),
                       future, StopStrings(params.stop, self.tokenizer) if params.stop else None,
                       sorted(stop_ids) if params.min_new_tokens else [], sink)
        self._waiting.append(req)
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
        if not 0 <= start < len(input_ids):
            raise ValueError(f"logprob_start_len {start} is not in [0, {len(input_ids)}) for a prompt of "
                             f"{len(input_ids)} tokens; send -1 (output tokens only) or a prompt position")

        @torch.inference_mode()
        def forward() -> list[float]:
            ids = torch.tensor([input_ids], device=self.forward.device)
            logits = self.forward.model(ids).logits[0, start:-1].float()
            return torch.log_softmax(logits, -1).gather(-1, ids[0, start + 1:, None]).squeeze(-1).tolist()

        return [None, *await asyncio.get_running_loop().run_in_executor(self._pool, forward)]

    def _finish(self, req: _Request, reason: str, matched: int | str | None = None) -> None:
        if not req.finished:
            req.done.set_result(Completion(list(req.output_ids), list(req.logprobs), reason, matched,
                                           len(req.input_ids), self.weight_version, req.cached_tokens))
            if req.sink is not None:
                req.sink.finished(req.done.result())

    def _unfinished(self) -> list[_Request]:
        """Every request not yet finished: waiting, running, or with its last token in flight."""
        seen = [*self._running, *(self._in_flight.rows if self._in_flight else []), *self._waiting]
        return [r for r in dict.fromkeys(seen) if not r.finished]

    def abort(self, rid: str | None = None) -> int:
        """Abort request ``rid`` (or all when ``None``): it returns at once with its committed
        output (a token still in flight is dropped). Returns how many requests were aborted."""
        hits = [r for r in self._unfinished() if rid is None or r.rid == rid]
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
        """Unfinished requests that hold a KV slot (decoding, or with their last token in flight)."""
        return sum(r.slot >= 0 for r in self._unfinished())

    # ---- flow control and weights ---------------------------------------------------------------

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
        output; ``in_place``: running requests keep their slots and resume on ``resume``. Requests
        arriving while paused wait. Returns once no step is in flight and every launched step is
        committed."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode '{mode}' is not supported; use 'abort' or 'in_place'")
        self._paused = True
        if mode == "abort":
            self.abort(None)
        async with self._quiet():
            pass

    def resume(self) -> None:
        self._paused = False
        self._error = None
        self._step_waiters = []
        self._wake.set()

    async def update_weights(self, receive: Callable[[], dict[str, torch.Tensor]], version: int) -> None:
        """Run ``receive`` (blocking: disk read or broadcast) off the loop while generation goes on,
        then drain the pipeline, swap the tensors in and set ``weight_version``. Raises what
        ``receive`` / the load raise. ``receive`` runs in a daemon thread: cancelled while it
        blocks (a broadcast whose sender is gone), the update is abandoned and the thread does not
        hold up the process's exit."""
        loop = asyncio.get_running_loop()
        tensors = await in_daemon_thread(receive)
        async with self._quiet():
            # cached keys and values are the old weights' (nothing is planned until this is done)
            self.flush_cache()
            await loop.run_in_executor(self._pool, self.forward.load_weights, tensors)
            self.weight_version = version

    # ---- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Schedule forever (cancel to stop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._drain_requests:  # a drain waiting for the lock goes first
                    async with self._step_lock:
                        await self._pipeline(loop)
                # no await since the pipeline last looked for work or a drain: no wake-up is lost
                self._wake.clear()
                await self._wake.wait()
        except Exception as exc:  # a dead engine must not leave callers waiting forever
            self._error = RuntimeError(f"inference engine failed: {type(exc).__name__}: {exc}")
            for req in self._unfinished():
                req.done.set_exception(self._error)
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

    def _plan(self) -> _Plan | None:
        """Compact slots and admit waiting requests; ``None`` when there is nothing to run. Counts
        the planned step's tokens as issued."""
        # a request whose last token is being sampled needs its slot no more: its result is
        # committed from the in-flight plan's rows, not from the slot
        alive = [r for r in self._running if not r.finished and r.issued < r.params.max_new_tokens]
        if self._paused:  # in-place pause keeps the running requests (and their slots) as they are
            self._running = alive
            return None
        n = len(alive)
        taken = {r.slot for r in alive if r.slot < n}
        holes = [s for s in range(n) if s not in taken]
        moves = []
        for req, dst in zip([r for r in alive if r.slot >= n], holes):
            moves.append((req.slot, dst, req.cached))
            self._move_slot_params(req.slot, dst)
            req.slot = dst
        if moves:  # otherwise still in slot order, as the previous plan left them
            alive.sort(key=lambda r: r.slot)
        prefill, shared = self._admit(n)
        self._running = alive + prefill
        if not self._running:
            return None
        positions = []
        for req in alive:
            positions.append(req.cached)
            req.issued += 1
        for req in prefill:
            req.issued += 1
        sample_positions = [p + 1 for p in positions] + [len(r.input_ids) for r in prefill]
        # the token this step draws for a request is its issued-th: before min_new_tokens, no stop id
        bans = [(row, req.banned_ids) for row, req in enumerate(alive + prefill)
                if req.issued <= req.params.min_new_tokens and req.banned_ids]
        return _Plan(moves, prefill, alive, positions, sample_positions, *shared, bans=bans)

    def _admit(self, n: int) -> tuple[list[_Request], tuple]:
        """Move waiting requests into slots ``n..``, up to ``max_prefill_tokens`` computed prompt
        tokens; returns them and the plan's ``(passes, twins, logit_rows)``.

        Each admitted request is, in this order of preference: the twin of one admitted before it
        in this step with the same prompt (nothing computed: its keys and values are copied after
        the forwards, it samples from the same logits row); a follower of the prefix cache entry
        sharing its longest prefix (that prefix copied, the rest computed; in the second forward
        when the entry is filled by this step's first); or computed in full. Every prompt computed
        and not already held whole by an entry is inserted into the cache."""
        self._clock += 1
        passes = (_PrefillPass(), _PrefillPass())
        computing: dict[tuple[int, ...], _Request] = {}  # prompt → the request of this step computing it
        source: dict[_Request, tuple[int, int]] = {}  # request → (pass, index in the pass)
        twins, deferred, prefill, budget = [], [], [], self.max_prefill_tokens
        while self._waiting and n + len(prefill) < self.max_running:
            req = self._waiting[0]
            if req.finished:
                self._waiting.popleft()
                continue
            key = tuple(req.input_ids) if self.share_prompts else None
            twin = computing.get(key)
            entry, shared = None, 0
            if twin is None and self.prefix is not None:
                tokens = np.asarray(req.input_ids, dtype=np.int64)
                entry, shared = self.prefix.match(tokens)
            start = len(req.input_ids) if twin is not None else min(shared, len(req.input_ids) - 1)
            if prefill and len(req.input_ids) - start > budget:
                break
            self._waiting.popleft()
            budget -= len(req.input_ids) - start
            req.slot = n + len(prefill)
            req.cached_tokens = start
            if req.sink is not None:
                req.sink.admitted(start)
            self._put_slot_params(req)
            prefill.append(req)
            if twin is not None:
                twins.append((twin, req))
                continue
            if key is not None:
                computing[key] = req
            step = 1 if start and entry.plan == self._clock else 0  # its prefix is filled by pass 0
            p = passes[step]
            if start:
                entry.used = self._clock
                p.copies.append((entry.row, req.slot, start))
            source[req] = (step, len(p.requests))
            p.requests.append(req)
            p.starts.append(start)
            if self.prefix is not None and shared < len(req.input_ids):
                if step == 0:  # usable by pass 1 of this step
                    self._insert(p, req, tokens)
                else:  # filled by pass 1: usable from the next step on
                    deferred.append((req, tokens))
        for req, tokens in deferred:
            self._insert(passes[1], req, tokens)
        offset = (0, len(passes[0].requests))
        rows = {req: offset[step] + i for req, (step, i) in source.items()}
        twin_of = {req: twin for twin, req in twins}
        logit_rows = [rows[twin_of.get(req, req)] for req in prefill]
        copies = [(twin.slot, req.slot, len(req.input_ids)) for twin, req in twins]
        return prefill, ([p for p in passes if p.requests], copies, logit_rows)

    def _insert(self, step: _PrefillPass, req: _Request, tokens: np.ndarray) -> None:
        entry = self.prefix.insert(tokens, self._clock)
        if entry is not None:
            step.inserts.append((req.slot, entry.row, len(tokens)))

    def flush_cache(self) -> None:
        """Forget every cached prefix (``/flush_cache``; weight updates do it themselves)."""
        if self.prefix is not None:
            self.prefix.clear()

    def _put_slot_params(self, req: _Request) -> None:
        """Write ``req``'s sampling parameters into the per-slot tables at its slot."""
        p, s = req.params, req.slot
        self._slot_temperature[s], self._slot_top_p[s], self._slot_top_k[s] = p.temperature, p.top_p, p.top_k
        self._slot_seed[s] = req.seed

    def _move_slot_params(self, src: int, dst: int) -> None:
        for table in (self._slot_temperature, self._slot_top_p, self._slot_top_k, self._slot_seed):
            table[dst] = table[src]

    @torch.inference_mode()
    def _launch(self, plan: _Plan) -> None:
        """Executor side: enqueue ``plan``'s slot moves, forward passes and sampling, and the copies
        of its results to the host; sets ``plan.tokens`` / ``logprobs`` / ``ready``. Waits for
        nothing on CUDA (the inputs of its decode rows are the previous step's ``_slot_tokens``)."""
        forward = self.forward
        for src, dst, length in plan.moves:  # in stream order, after the step in flight
            forward.cache.move(src, dst, length)
            self._slot_tokens[dst] = self._slot_tokens[src]
        logits = []
        n = len(plan.decode)
        if n:
            logits.append(forward.decode_batch(self._slot_tokens[:n], plan.positions))
        computed = []
        for step in plan.passes:
            for row, slot, length in step.copies:
                forward.cache.move(row, slot, length)
            seqs, slots = [r.input_ids for r in step.requests], [r.slot for r in step.requests]
            computed.append(forward.prefill(seqs, slots, step.starts) if any(step.starts) else
                            forward.prefill(seqs, slots))
            for slot, row, length in step.inserts:
                forward.cache.move(slot, row, length)
        for src, dst, length in plan.twins:
            forward.cache.move(src, dst, length)
        if computed:
            computed = torch.cat(computed) if len(computed) > 1 else computed[0]
            if plan.logit_rows != list(range(computed.shape[0])):
                index = torch.tensor(plan.logit_rows).to(computed.device, non_blocking=True)  # no wait on CUDA
                computed = computed[index]
            logits.append(computed)
        rows = n + len(plan.prefill)
        tokens, logprobs = sample(
            torch.cat(logits) if len(logits) > 1 else logits[0],
            temperature=torch.from_numpy(self._slot_temperature[:rows]),
            top_p=torch.from_numpy(self._slot_top_p[:rows]),
            top_k=torch.from_numpy(self._slot_top_k[:rows]),
            seeds=self._slot_seed[:rows],
            positions=plan.sample_positions,
            bans=plan.bans,
        )
        self._slot_tokens[:rows].copy_(tokens)
        if tokens.is_cuda:
            plan.tokens = torch.empty(rows, dtype=torch.int64, pin_memory=True).copy_(tokens, non_blocking=True)
            plan.logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=True).copy_(logprobs, non_blocking=True)
            plan.ready = torch.cuda.Event()
            plan.ready.record(torch.cuda.current_stream(tokens.device))
        else:
            plan.tokens, plan.logprobs = tokens, logprobs

    def _advance(self, plan: _Plan | None, done: _Plan | None) -> tuple[list[int], list[float]] | None:
        """Executor side, one call per pipeline iteration: launch ``plan`` (if any), then wait for
        ``done`` (the step launched before it, if any) and return its tokens and log-probs."""
        if plan is not None:
            self._launch(plan)
        if done is None:
            return None
        if done.ready is not None:
            done.ready.synchronize()
        return done.tokens.tolist(), done.logprobs.tolist()

    def _commit(self, plan: _Plan, tokens: list[int], logprobs: list[float]) -> None:
        """Append a launched step's tokens (one per row of ``plan``), finish requests on a stop token
        or at ``max_new_tokens``, and wake ``next_step`` waiters."""
        for req, token, logprob in zip(plan.rows, tokens, logprobs):
            # finished already: aborted while the step ran (its partial output was returned), or
            # stopped at the previous step (this is the one extra step it was planned for)
            if req.finished:
                continue
            assert len(req.output_ids) < req.issued, f"request {req.rid} commits more tokens than were issued"
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            if req.sink is not None:
                req.sink.token(token, logprob)
            # SGLang's order: stop strings, then stop tokens, then the length limit. A stop string
            # ending inside a token keeps that whole token (output_ids / logprobs stay one per token)
            matched = req.stop_strings.match(req.output_ids) if req.stop_strings is not None else None
            if matched is not None:
                self._finish(req, "stop", matched)
            elif token in req.stop_ids:
                self._finish(req, "stop", token)
            elif len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(req, "length")
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
