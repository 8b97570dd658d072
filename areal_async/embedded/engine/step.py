"""One engine step, pipelined one deep as SGLang's overlap scheduler: step n+1 is launched before
step n's tokens are read back, so while the device runs step n+1 the host commits step n and plans
step n+2.

``StepPipeline`` (mixed into ``Engine``) holds the three phases of one loop iteration: **plan** step
n+1 (``_plan``: drop finished requests, close the holes in the KV slots, admit waiting requests with
``_admit``), **launch** it and read step n back in one executor call (``_advance``, ``_launch``),
**commit** step n (``_commit``: append tokens, finish requests in SGLang's order). ``Plan`` is one step.

Invariants: running requests hold slots ``0..B-1``; a step's rows are its decode rows in slots
``0..n-1`` then its prefill rows in ``n..n+p-1``; decode reads its input tokens from ``_slot_tokens``
on the device (the previous step's, before the host has seen them), while positions are host ints
(``Request.issued``); the per-slot sampling tables move with the slots. On CUDA the results go to
pinned memory behind a recorded event; on CPU the same code runs synchronously and nothing overlaps.
The one-step lag: a request that samples a stop token at step n is decoded once more, and that token
is dropped at commit; one issued ``max_new_tokens`` tokens is never decoded again. A decode batch is
whatever runs, so logits can differ from a solo run in the last bits unless the forward is
batch-invariant; sampling noise never does (``sampling.py``). Prompt reuse (twins, cached prefixes)
is ``_admit``'s, saving a finished request's prompt and output for its episode's next turn
``_save_leaving``'s. The loop that calls these phases and the request queues are ``engine.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .requests import Request
from .sampling import sample


@dataclasses.dataclass(frozen=True)
class StepCommitted:
    """What ``Engine.next_step`` returns: the weight version of a committed step and whether every
    log-prob it computed is finite (NaN or inf: the weights in service are broken)."""

    weight_version: int
    finite: bool


@dataclasses.dataclass(eq=False)
class PrefillPass:
    """One prefill forward of a step: copy cached prefixes into the slots, run the rest of each
    prompt, then copy prompts into the prefix cache rows reserved for them."""

    copies: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (prefix row, slot, positions)
    requests: list[Request] = dataclasses.field(default_factory=list)  # in slot order
    starts: list[int] = dataclasses.field(default_factory=list)  # positions each slot already holds
    inserts: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (slot, prefix row, positions)


@dataclasses.dataclass(eq=False)
class Plan:
    """One step: decided by ``_plan`` (loop), launched by ``_launch`` (executor), committed by
    ``_commit`` (loop). Its rows are ``decode + prefill``, in slots ``0..len(rows)-1``."""

    moves: list[tuple[int, int, int]]  # (src slot, dst slot, positions to copy)
    prefill: list[Request]
    decode: list[Request]  # ordered by slot, slots 0..len-1
    positions: list[int]  # each decode row's input position
    sample_positions: list[int]  # each row's position of the token it draws
    # the prefill forwards (at most 2: the second reads prefixes the first stored), the copies of a
    # whole prompt into the slot of each later request of the step with the same prompt (after
    # the forwards), and each prefill request's row of the forwards' concatenated logits
    passes: list[PrefillPass] = dataclasses.field(default_factory=list)
    twins: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (src slot, dst slot, positions)
    logit_rows: list[int] = dataclasses.field(default_factory=list)
    # finished requests' prompt + output copied into prefix cache rows, before anything else (the
    # moves and prefills of this step may overwrite their slots)
    saves: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (slot, prefix row, positions)
    bans: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)  # (row, ids it cannot draw)
    tokens: torch.Tensor | None = None  # set by _launch: [rows] int64 on the host (pinned on CUDA)
    logprobs: torch.Tensor | None = None  # [rows] float32, same
    ready: torch.cuda.Event | None = None  # CUDA: fires when tokens / logprobs hold the results

    @property
    def rows(self) -> list[Request]:
        return self.decode + self.prefill


class StepPipeline:
    """The plan, launch and commit phases of ``Engine`` (module docstring). They read and write the
    engine's state, set up in ``Engine.__init__``: the request queues (``_waiting``, ``_running``),
    ``_in_flight``, the prefix cache and its ``_clock``, the per-slot tables (``_slot_tokens`` on the
    device; ``_slot_temperature``, ``_slot_top_p``, ``_slot_top_k``, ``_slot_seed`` on the host) and
    ``_step_waiters``; ``_plan`` and ``_commit`` run on the loop, ``_launch`` and ``_advance`` on the
    forward thread."""

    def _plan(self) -> Plan | None:
        """Compact slots and admit waiting requests; ``None`` when there is nothing to run. Counts
        the planned step's tokens as issued."""
        # a request whose last token is being sampled needs its slot no more: its result is
        # committed from the in-flight plan's rows, not from the slot
        alive = [r for r in self._running if not r.finished and r.issued < r.params.max_new_tokens]
        self._clock += 1
        if self.prefix is not None:
            staying = set(alive)
            self._save_leaving([r for r in self._running if r not in staying])
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
        saves, self._saves = self._saves, []
        return Plan(moves, prefill, alive, positions, sample_positions, *shared, bans=bans, saves=saves)

    def _save_leaving(self, leaving: list[Request]) -> None:
        """Reserve prefix cache rows for requests leaving their slots at this plan (finished, or
        their last token in flight), so an episode's next turn, whose prompt extends this one's
        prompt and output, copies their keys and values. Saved: the prompt and the committed output
        tokens whose keys and values launched steps wrote (``Request.cached`` positions: every
        token a later step took as its input; so a stop token is saved, the last token of a request
        cut at ``max_new_tokens`` is not), only when that adds a token to the prompt and only when
        they all come from the weights in service (``kv_version``; ``None`` once a swap happened
        while it held its slot). The copies run first in the next launched step."""
        for req in leaving:
            if req.slot < 0 or req.issued < 1 or req.kv_version != self.weight_version:
                continue
            tokens = req.input_ids + req.output_ids
            tokens = np.asarray(tokens[:min(req.cached, len(tokens))], dtype=np.int64)
            if len(tokens) <= len(req.input_ids) or self.prefix.match(tokens, self.weight_version)[1] == len(tokens):
                continue  # nothing beyond the prompt (inserted at admission), or held whole already
            entry = self.prefix.insert(tokens, self._clock, self.weight_version)
            if entry is not None:
                entry.plan = -1  # filled before any forward of the step that copies it
                self._saves.append((req.slot, entry.row, len(tokens)))

    def _admit(self, n: int) -> tuple[list[Request], tuple]:
        """Move waiting requests into slots ``n..``, up to ``max_prefill_tokens`` computed prompt
        tokens (copied ones are free; at least one request is admitted); returns them and the plan's
        ``(passes, twins, logit_rows)``.

        Prompt reuse (``prefix_cache=True``, the default; anchors: SGLang's parallel sampling, which
        prefills a prompt once for its ``n`` samples, and its radix cache). Each admitted request
        is, in this order of preference:

        - the *twin* of one admitted before it in this step with the same prompt (a group's
          samples): nothing computed, its keys and values are copied after the forwards and it
          samples (with its own seed) from the same logits row. A prefill row's result is a
          function of its own prompt in batch-invariant mode, so this is bitwise exact there, and
          it is on in every mode;
        - a follower of the prefix cache entry sharing its longest prefix (``prefix_cache.py``;
          throughput mode only): that prefix copied (capped one short of the prompt: its last token
          always runs, for the logits), the rest computed; in the second prefill forward when the
          entry is filled by this step's first, so a step of 8 few-shot prompts computes their
          preamble once;
        - computed in full.

        Every prompt computed, not already held whole by an entry and not extending one whole (a
        next turn, saved with its output as it leaves: ``_save_leaving``) is inserted into the
        cache, keyed by the weight
        version in service; lookups see only that version's entries, and the cache is also flushed
        on every weight update (before the swap) and on ``flush_cache``.
        Deterministic mode keeps only twins: a suffix attending to copied keys and values runs with
        other shapes than a whole prompt (the attention's blocking), so its last bits, and so a
        sampled token, could depend on whether the prefix happened to be cached, i.e. on timing."""
        passes = (PrefillPass(), PrefillPass())
        computing: dict[tuple[int, ...], Request] = {}  # prompt → the request of this step computing it
        source: dict[Request, tuple[int, int]] = {}  # request → (pass, index in the pass)
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
                entry, shared = self.prefix.match(tokens, self.weight_version)
            start = len(req.input_ids) if twin is not None else min(shared, len(req.input_ids) - 1)
            if prefill and len(req.input_ids) - start > budget:
                break
            self._waiting.popleft()
            budget -= len(req.input_ids) - start
            req.slot = n + len(prefill)
            req.cached_tokens = start
            req.kv_version = self.weight_version
            self.prompt_tokens_total += len(req.input_ids)
            self.cached_tokens_total += start
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
            # a prompt that extends its entry whole continues a cached sequence (an episode's next
            # turn): its prompt and output are saved as it leaves, and a row for the prompt alone
            # meanwhile would evict other episodes' turns
            extends = entry is not None and shared == len(entry.tokens)
            if self.prefix is not None and shared < len(req.input_ids) and not extends:
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

    def _insert(self, step: PrefillPass, req: Request, tokens: np.ndarray) -> None:
        entry = self.prefix.insert(tokens, self._clock, self.weight_version)
        if entry is not None:
            step.inserts.append((req.slot, entry.row, len(tokens)))


    def _put_slot_params(self, req: Request) -> None:
        """Write ``req``'s sampling parameters into the per-slot tables at its slot."""
        p, s = req.params, req.slot
        self._slot_temperature[s], self._slot_top_p[s], self._slot_top_k[s] = p.temperature, p.top_p, p.top_k
        self._slot_seed[s] = req.seed

    def _move_slot_params(self, src: int, dst: int) -> None:
        for table in (self._slot_temperature, self._slot_top_p, self._slot_top_k, self._slot_seed):
            table[dst] = table[src]

    @torch.inference_mode()
    def _launch(self, plan: Plan) -> None:
        """Executor side: enqueue ``plan``'s slot moves, forward passes and sampling, and the copies
        of its results to the host; sets ``plan.tokens`` / ``logprobs`` / ``ready``. Waits for
        nothing on CUDA (the inputs of its decode rows are the previous step's ``_slot_tokens``)."""
        forward = self.forward
        for slot, row, length in plan.saves:  # before the moves and prefills that may overwrite the slots
            forward.cache.move(slot, row, length)
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

    def _advance(self, plan: Plan | None, done: Plan | None) -> tuple[list[int], list[float]] | None:
        """Executor side, one call per pipeline iteration: launch ``plan`` (if any), then wait for
        ``done`` (the step launched before it, if any) and return its tokens and log-probs."""
        if self.cpu_share is not None:
            self.cpu_share.refresh()  # on this thread, which computes (cpu_threads: adaptive)
        if plan is not None:
            self._launch(plan)
        if done is None:
            return None
        if done.ready is not None:
            done.ready.synchronize()
        return done.tokens.tolist(), done.logprobs.tolist()

    def _commit(self, plan: Plan, tokens: list[int], logprobs: list[float]) -> None:
        """Append a launched step's tokens (one per row of ``plan``), finish requests on a stop token
        or at ``max_new_tokens``, and wake ``next_step`` waiters (every row's log-prob counts for
        ``finite``, a dropped extra token's too: the same weights made it)."""
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
        if waiters:
            step = StepCommitted(self.weight_version, all(map(math.isfinite, logprobs)))
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(step)
