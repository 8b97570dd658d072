"""The engine's one-deep step pipeline, on CPU with the tiny fp32 Llama.

Step n+1 is launched before step n is committed; its decode inputs come from the device-side
token buffer. These tests trace the forward calls and the commits to check the order, the one
extra step a stopped request costs (and that its token is dropped), exact ``max_new_tokens``,
aborts while a step is in flight, that weight updates and pauses find the pipeline drained, and that
a ``next_step`` waiter registered while paused is released by the first step after continue.
Deterministic mode (batch-invariant forward) makes "same output as alone" an exact comparison.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest
import torch

from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine
from tests.support.loop import settle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = {"a": [5, 17, 42, 99, 7], "b": [3, 250, 11], "c": [8, 9, 10, 11, 12, 13], "d": [77, 21]}


def params(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed, **kw})


class Trace:
    """Wraps an engine's forward calls and ``_commit``: what each forward call saw, and per commit
    which requests had rows in the step and whether each was already finished. Build it inside
    the running loop."""

    def __init__(self, engine):
        self.commits: list[list[tuple[str, bool]]] = []
        self.forward_calls: list[tuple[str, int]] = []  # (decode | prefill, commits so far)
        self.decode_inputs: list[list[int]] = []
        self.block_decode: int | None = None  # block the decode call with this index ...
        self.release = threading.Event()  # ... until this is set
        self.entered = asyncio.Event()  # set (from the executor thread) when that call blocks
        loop = asyncio.get_running_loop()
        forward = engine.forward
        decode, prefill, commit = forward.decode_batch, forward.prefill, engine._commit

        def traced_decode(tokens, positions):
            self.forward_calls.append(("decode", len(self.commits)))
            self.decode_inputs.append(torch.as_tensor(tokens).tolist())
            if len(self.decode_inputs) - 1 == self.block_decode:
                loop.call_soon_threadsafe(self.entered.set)
                assert self.release.wait(30), "the test never released the blocked decode"
            return decode(tokens, positions)

        def traced_prefill(*args):
            self.forward_calls.append(("prefill", len(self.commits)))
            return prefill(*args)

        def traced_commit(plan, tokens, logprobs):
            self.commits.append([(r.rid, r.finished) for r in plan.decode + plan.prefill])
            return commit(plan, tokens, logprobs)

        forward.decode_batch, forward.prefill, engine._commit = traced_decode, traced_prefill, traced_commit

    def rows_of(self, rid: str) -> list[bool]:
        """One entry per step that had a row for ``rid``: was it finished before that commit."""
        return [done for rows in self.commits for r, done in rows if r == rid]


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds (state the engine sets without an event to wait on)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


def make_engine(model_dir, slots: int = 4):
    engine, _ = load_engine(str(model_dir), "float32", "cpu", slots, 128, deterministic=True)
    return engine


async def started(engine):
    task = asyncio.create_task(engine.run())
    await asyncio.sleep(0)
    return task


async def stop(task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_next_step_is_launched_before_the_previous_one_is_committed(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        trace = Trace(engine)
        task = await started(engine)
        out = await engine.generate(PROMPTS["a"], params(6, 1), "a")
        await stop(task)
        return trace, out

    trace, out = asyncio.run(main())
    # forward call k is step k (one request: a prefill, then one decode per token); when step
    # k+1 is launched only steps 0..k-1 are committed (without the pipeline: 0..k)
    assert [kind for kind, _ in trace.forward_calls] == ["prefill"] + ["decode"] * 5
    assert [commits for _, commits in trace.forward_calls] == [0, 0, 1, 2, 3, 4]
    # the decode inputs came from the device-side buffer, before the host read them back
    assert trace.decode_inputs == [[t] for t in out.output_ids[:5]]
    assert len(out.output_ids) == 6 and out.finish_reason == "length"


def test_stopped_request_is_decoded_once_more_and_its_extra_token_dropped(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir, slots=3)
        task = await started(engine)
        specs = {"a": (16, 1), "b": (12, 2), "c": (14, 3), "d": (6, 4)}  # max_new_tokens, seed
        alone = {rid: await engine.generate(PROMPTS[rid], params(*spec), rid) for rid, spec in specs.items()}
        stop_token = alone["a"].output_ids[3]
        trace = Trace(engine)
        moves = []
        plan = engine._plan

        def traced_plan():
            step = plan()
            moves.extend(step.moves if step else [])
            return step

        engine._plan = traced_plan
        # 3 slots: "a" stops early in slot 0, "c" (slot 2) moves into its hole, "d" waits for a slot
        together = await asyncio.gather(
            # without ignore_eos, which turns stop_token_ids off too (SGLang's token-based finish)
            engine.generate(PROMPTS["a"], params(*specs["a"], stop_token_ids=[stop_token], ignore_eos=False), "a"),
            *(engine.generate(PROMPTS[rid], params(*specs[rid]), rid) for rid in "bcd"))
        await stop(task)
        return alone, dict(zip("abcd", together)), stop_token, trace, moves

    alone, together, stop_token, trace, moves = asyncio.run(main())
    stop_at = alone["a"].output_ids.index(stop_token)
    assert stop_at < 10 and moves[0][:2] == (2, 0)  # "a" finished first; "c" moved into slot 0
    a = together["a"]
    assert a.finish_reason == "stop" and a.matched == stop_token
    assert a.output_ids == alone["a"].output_ids[: stop_at + 1]
    assert a.logprobs == alone["a"].logprobs[: stop_at + 1]
    # stop_at + 1 steps made its tokens; one more was planned before the stop was seen, and
    # committing it found the request finished (its token dropped); then its slot was freed
    assert trace.rows_of("a") == [False] * (stop_at + 1) + [True]
    for rid in "bcd":  # moved, admitted late: bitwise their solo runs (deterministic mode)
        assert together[rid].output_ids == alone[rid].output_ids, rid
        assert together[rid].logprobs == alone[rid].logprobs, rid
        assert trace.rows_of(rid) == [False] * len(alone[rid].output_ids), rid


def test_max_new_tokens_is_exact_with_no_extra_step(tiny_model_dir):
    lengths = {"a": 1, "b": 2, "c": 5, "d": 9}

    async def main():
        engine = make_engine(tiny_model_dir)
        trace = Trace(engine)
        task = await started(engine)
        done = await asyncio.gather(*(engine.generate(PROMPTS[rid], params(n, seed), rid)
                                      for seed, (rid, n) in enumerate(lengths.items())))
        await stop(task)
        return trace, dict(zip(lengths, done))

    trace, done = asyncio.run(main())
    for rid, n in lengths.items():
        assert len(done[rid].output_ids) == len(done[rid].logprobs) == n and done[rid].finish_reason == "length"
        assert trace.rows_of(rid) == [False] * n, rid  # one row per token: a prefill, n - 1 decodes
    assert sum(len(tokens) for tokens in trace.decode_inputs) == sum(n - 1 for n in lengths.values())


def test_abort_returns_at_once_while_a_step_is_in_flight(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        trace = Trace(engine)
        # decode call 2 is step 3: "b" (3 tokens) issued its last token in step 2, which is not
        # committed yet, and is no longer decoded; "a" has steps 2 and 3 in flight
        trace.block_decode = 2
        task = await started(engine)
        a = asyncio.create_task(engine.generate(PROMPTS["a"], params(40, 1), "a"))
        b = asyncio.create_task(engine.generate(PROMPTS["b"], params(3, 2), "b"))
        await asyncio.wait_for(trace.entered.wait(), 10)
        assert engine.num_running == 2
        hits = engine.abort("b"), engine.abort("a")
        # both return while the forward is still blocked: nothing waits for the step in flight
        done = await asyncio.wait_for(asyncio.gather(a, b), timeout=10)
        assert not trace.release.is_set()
        trace.release.set()
        after = await engine.generate(PROMPTS["c"], params(4, 3), "c")
        await stop(task)
        return hits, done, after, trace, engine.num_running

    hits, (a, b), after, trace, running = asyncio.run(main())
    assert hits == (1, 1)
    for c in (a, b):  # the two committed steps (0, 1); steps 2 and 3 were dropped
        assert c.finish_reason == "abort" and len(c.output_ids) == len(c.logprobs) == 2
    assert trace.rows_of("b") == [False, False, True]
    assert after.finish_reason == "length" and len(after.output_ids) == 4 and running == 0


def test_weight_update_drains_the_pipeline_and_versions_follow_the_weights(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        trace = Trace(engine)
        trace.block_decode = 2  # as in the abort test: "b"'s last token (step 2) is in flight
        seen = []
        load = engine.forward.load_weights

        def traced_load(tensors):
            seen.append((engine._in_flight, len(trace.commits), len(trace.forward_calls)))
            return load(tensors)

        engine.forward.load_weights = traced_load
        task = await started(engine)
        a = asyncio.create_task(engine.generate(PROMPTS["a"], params(12, 1), "a"))
        b = asyncio.create_task(engine.generate(PROMPTS["b"], params(3, 2), "b"))
        await asyncio.wait_for(trace.entered.wait(), 10)
        # paused in place, the swap happens between two steps (SGLang's update of a paused server);
        # the pause waits for the drain, the update then finds it drained
        pause = asyncio.create_task(engine.pause("in_place"))
        await until(lambda: engine._drain_requests)
        trace.release.set()
        await pause
        await engine.update_weights(lambda: {}, 7)
        engine.continue_generation()
        done = await asyncio.gather(a, b)
        await stop(task)
        return seen, done, trace

    seen, (a, b), trace = asyncio.run(main())
    in_flight, commits, forward_calls = seen[0]
    # the load found no step in flight and every launched step committed: step 0 (2 prefills in
    # one call) and decodes 1..3, 4 steps
    assert in_flight is None and commits == 4 and forward_calls == 4
    assert b.weight_version == 0 and len(b.output_ids) == 3  # its last token came from version 0
    assert a.weight_version == 7 and len(a.output_ids) == 12  # resumed after the swap


def perturbed_tensors(model_dir) -> dict[str, torch.Tensor]:
    """The tiny model's parameters moved by N(0, 0.3²): other tokens than the original's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    return {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def test_an_unpaused_update_waits_for_running_requests_and_holds_new_ones(tiny_model_dir):
    # SGLang's model-update lock: "a" (running when the update is called) ends under the old
    # weights, "b" (arriving while the update waits) is held and runs under the new ones. Each is
    # compared with a run alone under one set of weights (deterministic mode: exact), so a token
    # from the other weights fails the test.
    new = perturbed_tensors(tiny_model_dir)

    async def main():
        engine = make_engine(tiny_model_dir)
        task = await started(engine)
        old_a = await engine.generate(PROMPTS["a"], params(12, 1), "a")
        old_b = await engine.generate(PROMPTS["b"], params(6, 2), "b")
        seen = []
        load = engine.forward.load_weights

        def traced_load(tensors):
            seen.append((len(engine._unfinished()), engine.num_running))
            return load(tensors)

        engine.forward.load_weights = traced_load
        a = asyncio.create_task(engine.generate(PROMPTS["a"], params(12, 1), "a"))
        for _ in range(3):
            await engine.next_step()
        loop, receiving = asyncio.get_running_loop(), asyncio.Event()

        def receive():  # on the update's daemon thread, as a broadcast or a disk read
            loop.call_soon_threadsafe(receiving.set)
            return new

        update = asyncio.create_task(engine.update_weights(receive, 7))
        await asyncio.wait_for(receiving.wait(), 10)  # the update is under way ("a" has 9 tokens to go)
        b = asyncio.create_task(engine.generate(PROMPTS["b"], params(6, 2), "b"))
        await until(lambda: engine._held or b.done())  # held back, not queued for the next step
        held_while_a_ran = not a.done() and not update.done()
        a_done = await a
        await update
        b_done = await b
        await stop(task)
        fresh = make_engine(tiny_model_dir)
        await asyncio.get_running_loop().run_in_executor(None, fresh.forward.load_weights, new)
        task = await started(fresh)
        new_b = await fresh.generate(PROMPTS["b"], params(6, 2), "b")
        await stop(task)
        return old_a, old_b, new_b, a_done, b_done, seen, held_while_a_ran

    old_a, old_b, new_b, a, b, seen, held_while_a_ran = asyncio.run(main())
    assert seen == [(1, 0)]  # at the swap: "a" finished, "b" the one unfinished request, holding no slot
    assert a.weight_version == 0 and (a.output_ids, a.logprobs) == (old_a.output_ids, old_a.logprobs)
    assert b.weight_version == 7 and (b.output_ids, b.logprobs) == (new_b.output_ids, new_b.logprobs)
    assert new_b.output_ids != old_b.output_ids  # the new weights do change the tokens
    assert held_while_a_ran


def test_in_place_pause_drains_and_resume_continues_exactly(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        task = await started(engine)
        alone = await engine.generate(PROMPTS["a"], params(12, 1), "a")
        trace = Trace(engine)
        run = asyncio.create_task(engine.generate(PROMPTS["a"], params(12, 1), "a"))
        for _ in range(3):
            await engine.next_step()
        await engine.pause("in_place")
        state = engine._in_flight, len(trace.commits), len(trace.forward_calls), engine.num_running
        engine.continue_generation()
        resumed = await run
        await stop(task)
        return alone, resumed, state

    alone, resumed, (in_flight, commits, forward_calls, running) = asyncio.run(main())
    assert in_flight is None and commits == forward_calls and running == 1  # still holds its slot
    assert resumed.output_ids == alone.output_ids and resumed.logprobs == alone.logprobs


def test_a_step_waiter_registered_while_paused_is_released_by_the_first_step_after_continue(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        task = await started(engine)
        run = asyncio.create_task(engine.generate(PROMPTS["a"], params(12, 1), "a"))
        await engine.next_step()
        await engine.pause("in_place")
        waiter = asyncio.ensure_future(engine.next_step())
        await settle()
        pending_while_paused = not waiter.done()  # paused: no step runs, so none can release it
        engine.continue_generation()
        # the request paused in place goes on: its steps after continue commit, and the first of
        # them releases the waiter (its last one has committed once ``run`` is done)
        result = await run
        released = waiter.done()
        waiter.cancel()  # a no-op once released; else a waiter left behind, so the loop can close
        await stop(task)
        return pending_while_paused, released, waiter, result

    pending_while_paused, released, waiter, result = asyncio.run(main())
    assert pending_while_paused and len(result.output_ids) == 12
    assert released, "a next_step waiter registered while paused was never released by the steps after continue"
    assert waiter.result().weight_version == 0 and waiter.result().finite


def test_update_is_not_starved_by_a_steady_stream_of_requests(tiny_model_dir):
    async def main():
        engine = make_engine(tiny_model_dir)
        task = await started(engine)
        stream = collections.deque()

        async def feed():
            for i in range(200):  # always something waiting: the pipeline would never run dry
                stream.append(asyncio.create_task(engine.generate(PROMPTS["d"], params(4, i), f"s{i}")))
                await engine.next_step()

        feeder = asyncio.create_task(feed())
        await engine.next_step()
        await asyncio.wait_for(engine.update_weights(lambda: {}, 3), timeout=30)
        version_seen = engine.weight_version
        feeder.cancel()
        engine.abort(None)
        await asyncio.gather(feeder, *stream, return_exceptions=True)
        await stop(task)
        return version_seen

    assert asyncio.run(main()) == 3
