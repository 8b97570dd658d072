"""Prompt reuse in the embedded engine (``prefix_cache.py``, ``Engine._admit``), on CPU with the
tiny fp32 Llama.

Reference for every comparison: the same requests on an engine with the prefix cache off, which
computes every prompt in full. In throughput mode a reused prefix changes the prefill's shapes
(the suffix attends to copied keys and values), so log-probs may differ in the last bits: tokens
must be identical and log-probs equal within 1e-5 (fp32 logits of the tiny model are O(1); an
ulp is ~1e-7). Deterministic mode reuses only a prompt repeated within a step, and must be
bitwise equal.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.embedded.engine.prefix_cache import PrefixCache
from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PREAMBLE = [(7 * i + 3) % 300 + 20 for i in range(40)]  # a shared few-shot-like preamble
QUESTIONS = [[5, 17, 42], [99, 7, 250, 11], [8, 9], [77, 21, 30, 31, 32], [60, 61, 62]]


def prompts() -> list[list[int]]:
    return [PREAMBLE + q for q in QUESTIONS]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, sampling_seed=0)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)


def make_engine(model_dir, prefix_cache: bool, slots: int = 4, deterministic: bool = False, entries: int = 8):
    engine, _ = load_engine(str(model_dir), "float32", "cpu", slots, 128, deterministic=deterministic,
                            prefix_cache=prefix_cache, prefix_cache_entries=entries)
    return engine


async def run_all(engine, requests: list[tuple[list[int], SamplingParams]], waves: list[int] | None = None):
    """Generate ``requests`` (prompt, params) on ``engine``; ``waves``: sizes of batches sent one
    after the other (each waits for the previous), else all at once."""
    task = asyncio.create_task(engine.run())
    out, i = [], 0
    for size in waves or [len(requests)]:
        batch = requests[i : i + size]
        out += await asyncio.gather(*(engine.generate(p, sp, f"s{i + j}") for j, (p, sp) in enumerate(batch)))
        i += size
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return out


def group_requests(n_samples: int = 4, new_tokens: int = 6) -> list[tuple[list[int], SamplingParams]]:
    """A rollout batch in miniature: each prompt sent ``n_samples`` times with distinct seeds."""
    return [(p, sampled(new_tokens, 100 * g + i)) for g, p in enumerate(prompts()) for i in range(n_samples)]


def assert_same(with_cache, without, atol: float = 1e-5) -> None:
    for a, b in zip(with_cache, without, strict=True):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=atol, rtol=0), np.abs(np.subtract(a.logprobs, b.logprobs)).max()


# ---- the index --------------------------------------------------------------------------------------


def test_match_finds_the_longest_common_prefix_and_lru_spares_what_a_step_uses():
    cache = PrefixCache([10, 11])
    a = cache.insert(np.array([1, 2, 3, 4]), plan=1, version=0)
    b = cache.insert(np.array([1, 2, 9]), plan=1, version=0)
    assert {a.row, b.row} == {10, 11}
    assert cache.match(np.array([1, 2, 3, 7]), 0) == (a, 3)  # 3 shared with a, 2 with b
    assert cache.match(np.array([1, 2, 9, 9, 9]), 0) == (b, 3)
    assert cache.match(np.array([1, 2]), 0) == (a, 2)  # a prompt inside an entry: all of it; tie → earliest
    assert cache.match(np.array([5, 1, 2]), 0) == (None, 0)
    assert cache.insert(np.array([6]), plan=1, version=0) is None  # both rows are used by step 1
    a.used = 3  # step 3 read a: b is now the least recently used
    c = cache.insert(np.array([6, 6]), plan=4, version=0)
    assert c.row == b.row and len(cache) == 2 and cache.match(np.array([1, 2, 9]), 0)[1] == 2
    cache.clear()
    assert len(cache) == 0 and cache.match(np.array([1, 2, 3]), 0) == (None, 0)
    with pytest.raises(ValueError, match="prefix_cache_entries >= 1"):
        PrefixCache([])


def test_an_entry_matches_only_at_the_weight_version_it_was_computed_under():
    cache = PrefixCache([10, 11, 12])
    old = cache.insert(np.array([1, 2, 3, 4]), plan=1, version=3)
    assert cache.match(np.array([1, 2, 3, 4, 5]), 3) == (old, 4)  # reused within its version
    assert cache.match(np.array([1, 2, 3, 4, 5]), 4) == (None, 0)  # never after an update
    assert cache.match(np.array([1, 2, 3, 4, 5]), 2) == (None, 0)
    new = cache.insert(np.array([1, 2]), plan=2, version=4)  # a shorter entry of the new version
    assert cache.match(np.array([1, 2, 3, 4, 5]), 4) == (new, 2)
    # an insert extending an entry of its own version takes its row (the next turn of an episode);
    # one extending an entry of another version does not
    longer = cache.insert(np.array([1, 2, 3, 4, 5, 6]), plan=5, version=4)
    assert longer.row == new.row and len(cache) == 2
    assert cache.match(np.array([1, 2, 3, 4, 5, 6, 7]), 4) == (longer, 6)
    assert cache.match(np.array([1, 2, 3, 4, 5, 6, 7]), 3) == (old, 4)
    # every idle entry of its version that it extends is dropped: their rows are free again
    cache.insert(np.array([1, 2, 3, 4, 5, 6, 7, 8]), plan=6, version=3)
    assert cache.insert(np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), plan=7, version=4).row == longer.row
    assert len(cache) == 2 and cache.match(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 3)[1] == 8


# ---- results with reuse equal results without ------------------------------------------------------


@pytest.mark.parametrize("waves", [None, [4, 4, 4, 4, 4], [1, 19]], ids=["one-batch", "group-by-group", "preamble-first"])
def test_sampled_groups_with_reuse_equal_the_same_requests_without(tiny_model_dir, waves):
    requests = group_requests()

    async def main():
        on = make_engine(tiny_model_dir, True, slots=8)
        off = make_engine(tiny_model_dir, False, slots=8)
        return await run_all(on, requests, waves), await run_all(off, requests, waves)

    with_cache, without = asyncio.run(main())
    assert_same(with_cache, without)
    cached = [c.cached_tokens for c in with_cache]
    assert all(c == 0 for c in (c.cached_tokens for c in without))
    # each group's later samples copy the whole prompt (a twin in the step, or a cached entry: all
    # but the last token); from the second group on, the first sample reuses at least the preamble
    for g, p in enumerate(prompts()):
        first, rest = cached[4 * g], cached[4 * g + 1 : 4 * g + 4]
        assert all(c >= len(p) - 1 for c in rest), (g, cached)
        assert g == 0 or first >= len(PREAMBLE), (g, cached)
    assert cached[0] == 0


def test_greedy_waves_through_a_small_cache_equal_no_reuse(tiny_model_dir):
    # 2 slots and 1 entry: requests queue, entries are replaced, the second forward of a step
    # reads an entry its first forward filled; greedy tokens identical, log-probs within 1e-5
    requests = [(p, greedy(8)) for p in prompts() * 2]

    async def main():
        on = make_engine(tiny_model_dir, True, slots=2, entries=1)
        off = make_engine(tiny_model_dir, False, slots=2)
        return await run_all(on, requests), await run_all(off, requests)

    with_cache, without = asyncio.run(main())
    assert_same(with_cache, without)
    assert sum(c.cached_tokens for c in with_cache) >= (len(requests) - 1) * len(PREAMBLE)


def test_a_step_computes_a_shared_preamble_once_then_only_the_suffixes(tiny_model_dir):
    calls = []

    async def main():
        engine = make_engine(tiny_model_dir, True, slots=10)
        prefill = engine.forward.prefill

        def traced(seqs, slots, starts=None):
            calls.append([len(s) - st for s, st in zip(seqs, starts or [0] * len(seqs))])
            return prefill(seqs, slots, starts)

        engine.forward.prefill = traced
        return await run_all(engine, group_requests(n_samples=2))

    out = asyncio.run(main())
    # one step (all 10 requests fit): the first prompt in full, then the 4 other suffixes in a
    # second forward that reads the preamble the first stored; each prompt's twin computes nothing
    assert calls[0] == [len(prompts()[0])]
    assert calls[1] == [len(q) for q in QUESTIONS[1:]]
    assert [c.cached_tokens for c in out] == [0, len(prompts()[0])] + [
        n for p in prompts()[1:] for n in (len(PREAMBLE), len(p))]


def test_a_continuation_after_an_abort_reuses_its_prompt_and_continues_as_without(tiny_model_dir):
    # a paused generation is resubmitted as prompt + partial output (the client's interruptible
    # generation): the prompt comes from the cache, only the partial output runs
    prompt = prompts()[1]

    async def main(prefix_cache):
        engine = make_engine(tiny_model_dir, prefix_cache)
        task = asyncio.create_task(engine.run())
        head = await engine.generate(prompt, sampled(5, 3), "a")
        tail = await engine.generate(prompt + head.output_ids, sampled(7, 3), "a")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return head, tail

    (head, tail), (head_off, tail_off) = asyncio.run(main(True)), asyncio.run(main(False))
    assert_same([head, tail], [head_off, tail_off])
    # the head left its prompt and output in the cache: all but its last token, cut at
    # max_new_tokens before any step took it as input (its keys and values were never written)
    assert tail.cached_tokens == len(prompt) + len(head.output_ids) - 1


# ---- episodes: each turn's prompt extends the previous turn's prompt and output ----------------------


OBSERVATIONS = [[30, 31, 32, 33], [40, 41, 42]]  # tokens an environment appends after turns 1 and 2


async def episode(engine, first_stop: int | None) -> list:
    """Three sampled turns (fixed seeds); turn t+1's prompt = turn t's prompt + output + an observation. Turn 1
    stops at ``first_stop`` (a stop token), turn 2 at its length limit."""
    task = asyncio.create_task(engine.run())
    prompt, out = prompts()[0], []
    for t, params in enumerate([
        SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=[first_stop] if first_stop else [],
                       sampling_seed=0), sampled(6, 1), sampled(5, 2)]):  # ignore_eos would ignore the stop id too
        if t:
            prompt = prompt + out[-1].output_ids + OBSERVATIONS[t - 1]
        out.append(await engine.generate(prompt, params, f"turn{t}"))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return out


def first_new_token(ids: list[int]) -> int:
    """The first token of ``ids`` after position 2 that is not among those before it (a stop token
    that ends turn 1 after a few tokens)."""
    return next(t for j, t in enumerate(ids) if j >= 2 and t not in ids[:j])


@pytest.mark.parametrize("deterministic", [False, True], ids=["throughput", "deterministic"])
def test_a_turn_reuses_its_episodes_earlier_turns_and_equals_a_cold_run(tiny_model_dir, deterministic):
    async def main():
        probe = await episode(make_engine(tiny_model_dir, False, deterministic=deterministic), None)
        stop = first_new_token(probe[0].output_ids)
        on = await episode(make_engine(tiny_model_dir, True, deterministic=deterministic), stop)
        off = await episode(make_engine(tiny_model_dir, False, deterministic=deterministic), stop)
        return on, off

    on, off = asyncio.run(main())
    assert on[0].finish_reason == "stop" and on[1].finish_reason == "length"
    turn_prompts = [prompts()[0]]
    for t in (1, 2):
        turn_prompts.append(turn_prompts[-1] + on[t - 1].output_ids + OBSERVATIONS[t - 1])
    if deterministic:
        # no cross-request reuse there (a suffix over copied keys and values is not bitwise a full
        # prefill): every turn is computed in full and equals the cold run bitwise
        assert [c.cached_tokens for c in on] == [0, 0, 0]
        assert [c.output_ids for c in on] == [c.output_ids for c in off]
        assert [c.logprobs for c in on] == [c.logprobs for c in off]
        return
    # throughput mode: tokens identical, log-probs within 1e-5 of computing every prompt in full
    assert_same(on, off)
    assert on[0].cached_tokens == 0
    # turn 2 copies turn 1's prompt and whole output, its stop token included (decoded once more
    # after it was drawn); turn 3 all of turn 2's but the last token, cut at max_new_tokens
    assert on[1].cached_tokens == len(turn_prompts[0]) + len(on[0].output_ids)
    assert on[2].cached_tokens == len(turn_prompts[1]) + len(on[1].output_ids) - 1
    assert [c.prompt_tokens for c in on] == [len(p) for p in turn_prompts]


@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "not-flushed"])
def test_kv_of_an_old_weight_version_is_never_reused_by_the_next_turn(tiny_model_dir, flush):
    # turn 1 runs under version 0; an update to version 1 is asked while it runs and swaps once it
    # has finished; turn 2 (extending turn 1) is admitted right after the swap. It must equal turn 2
    # on an engine that only ever had version 1's weights, and copy nothing. "not-flushed": the
    # swap's flush is disabled, so the version keying alone must keep the old KV out
    new = perturbed_tensors(tiny_model_dir)
    prompt = prompts()[1]

    async def main():
        engine = make_engine(tiny_model_dir, True)
        if not flush:
            engine.flush_cache = lambda: None
        task = asyncio.create_task(engine.run())
        await engine.generate(prompt[:-3], sampled(4, 0), "warm")  # an entry of version 0 sharing the prompt's start
        turn1 = asyncio.create_task(engine.generate(prompt, sampled(6, 1), "t1"))
        while not engine.num_running:
            await asyncio.sleep(0)
        update = asyncio.create_task(engine.update_weights(lambda: new, 1))
        first = await turn1
        turn2_prompt = prompt + first.output_ids + OBSERVATIONS[0]
        second = await engine.generate(turn2_prompt, sampled(6, 2), "t2")
        await update
        again = await engine.generate(turn2_prompt + second.output_ids, sampled(3, 3), "t3")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fresh = make_engine(tiny_model_dir, False)
        await asyncio.get_running_loop().run_in_executor(None, fresh.forward.load_weights, new)
        cold = await run_all(fresh, [(turn2_prompt, sampled(6, 2)), (turn2_prompt + second.output_ids, sampled(3, 3))])
        return first, second, again, cold, engine

    first, second, again, cold, engine = asyncio.run(main())
    assert first.weight_version == 0 and second.weight_version == 1
    assert second.cached_tokens == 0  # nothing of version 0 reused
    assert_same([second, again], cold)
    assert again.cached_tokens > len(prompt)  # reuse within version 1 goes on
    assert all(e.version == 1 for e in engine.prefix._entries) or not flush


def test_a_request_paused_in_place_across_a_swap_is_not_saved_for_its_next_turn(tiny_model_dir):
    # its slot's keys and values mix the weights before and after the swap, so none of them may
    # serve its next turn, even when the update re-sends the same version number (a resent version
    # after a failed broadcast: docs/faults.md)
    new = perturbed_tensors(tiny_model_dir)
    prompt = prompts()[3]

    async def main():
        engine = make_engine(tiny_model_dir, True)
        task = asyncio.create_task(engine.run())
        turn1 = asyncio.create_task(engine.generate(prompt, sampled(12, 1), "t1"))
        await engine.next_step()
        await engine.next_step()
        await engine.pause("in_place")
        await engine.update_weights(lambda: new, 0)  # the same version number, other weights
        engine.continue_generation()
        first = await turn1
        second = await engine.generate(prompt + first.output_ids + OBSERVATIONS[0], sampled(4, 2), "t2")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return first, second

    first, second = asyncio.run(main())
    assert first.finish_reason == "length" and len(first.output_ids) == 12
    assert second.cached_tokens == 0


# ---- deterministic mode --------------------------------------------------------------------------


def test_deterministic_mode_reuses_only_a_prompt_within_a_step_and_stays_bitwise_exact(tiny_model_dir):
    requests = group_requests()

    async def main():
        on = make_engine(tiny_model_dir, True, slots=8, deterministic=True)
        assert on.prefix is None  # no cross-request reuse: it would change the prefill's shapes
        off = make_engine(tiny_model_dir, False, slots=8, deterministic=True)
        alone = make_engine(tiny_model_dir, True, slots=8, deterministic=True)
        return (await run_all(on, requests), await run_all(off, requests),
                await run_all(alone, requests, waves=[1] * len(requests)))

    with_cache, without, one_by_one = asyncio.run(main())
    for a, b, c in zip(with_cache, without, one_by_one, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids
        assert a.logprobs == b.logprobs == c.logprobs  # bitwise
    assert any(c.cached_tokens for c in with_cache)  # twins did share
    assert not any(c.cached_tokens for c in one_by_one)  # nothing is reused across steps


# ---- invalidation ---------------------------------------------------------------------------------


def perturbed_tensors(model_dir) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    return {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def test_a_weight_update_invalidates_the_cache(tiny_model_dir, tmp_path):
    # the same prompts before and after an update: after it, results must be those of an engine
    # that only ever had the new weights (a stale cached prefix gives other log-probs)
    new = perturbed_tensors(tiny_model_dir)
    requests = [(p, greedy(6)) for p in prompts()]

    async def main():
        engine = make_engine(tiny_model_dir, True)
        task = asyncio.create_task(engine.run())
        before = await asyncio.gather(*(engine.generate(p, sp, f"a{i}") for i, (p, sp) in enumerate(requests)))
        assert len(engine.prefix) > 0
        await engine.update_weights(lambda: new, 1)
        after = await asyncio.gather(*(engine.generate(p, sp, f"b{i}") for i, (p, sp) in enumerate(requests)))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fresh = make_engine(tiny_model_dir, False)
        await asyncio.get_running_loop().run_in_executor(None, fresh.forward.load_weights, new)
        return before, after, await run_all(fresh, requests)

    before, after, fresh = asyncio.run(main())
    assert_same(after, fresh)
    assert [a.output_ids for a in after] != [b.output_ids for b in before]
    assert after[0].cached_tokens == 0  # computed afresh after the update


def test_flush_cache_empties_the_prefix_cache(tiny_model_dir):
    from tests.support.servers import running

    prompt = prompts()[0]

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            first = await api.generate(prompt, max_new_tokens=2, temperature=0.0)
            again = await api.generate(prompt, max_new_tokens=2, temperature=0.0)
            flushed = await api.post("/flush_cache")
            after = await api.generate(prompt, max_new_tokens=2, temperature=0.0)
            return first, again, flushed, after, len(engine.prefix)

    first, again, flushed, after, entries = asyncio.run(main())
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last token always runs
    assert flushed[0] == 200
    assert after["meta_info"]["cached_tokens"] == 0 and entries == 1


def test_an_aborted_twin_leaves_its_group_as_without_reuse(tiny_model_dir):
    # four samples of one prompt admitted in one step; the one whose slot computes the prompt is
    # aborted right after the step is planned: the three others still get its keys, values and logits
    prompt = prompts()[2]

    async def main(prefix_cache):
        engine = make_engine(tiny_model_dir, prefix_cache)
        admit = engine._admit

        def admit_then_abort(n):
            admitted = admit(n)
            engine.abort("s0")
            return admitted

        engine._admit = admit_then_abort
        return await run_all(engine, [(prompt, sampled(6, i)) for i in range(4)])

    with_cache, without = asyncio.run(main(True)), asyncio.run(main(False))
    assert with_cache[0].finish_reason == without[0].finish_reason == "abort"
    assert with_cache[0].output_ids == without[0].output_ids == []
    assert_same(with_cache[1:], without[1:])
    assert [c.cached_tokens for c in with_cache[1:]] == [len(prompt)] * 3
