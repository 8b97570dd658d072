"""Host cost of one engine step (scheduling, bookkeeping, sampling's Python) at many running requests.

    python tools/bench_engine_host.py [--requests 256] [--new-tokens 64] [--forward fake|tiny]
        [--engine-file PATH] [--repeats 3]

``--forward fake`` (default): a stand-in for ``BatchedForward`` whose decode and prefill return a
preallocated ``[n, V]`` logits tensor (V = ``--vocab``) without computing anything, so each engine
step costs only what the host does around the forward on a GPU: planning (``Engine._plan``),
committing (``Engine._commit``), and launching the step (input tensors, ``sample`` over tiny
logits, token bookkeeping). ``--forward tiny``: the real ``BatchedForward`` over a random 2-layer,
hidden-64 Llama (CPU compute included). ``--engine-file`` loads another copy of ``engine.py`` (e.g.
an older revision) in place of ``areal_async.embedded.engine.engine``, to compare the two.

All requests arrive at once (``--prompt-len`` random tokens, ``ignore_eos``, T = 1, per-request
seeds), so after one prefill step every step decodes all of them. One torch thread. Prints µs per
step: total wall time / steps, and the parts spent in ``_plan`` and ``_commit`` (the rest is the
executor call: launch, sampling and collecting the results, plus the loop's own overhead).

On CPU nothing overlaps, so these are plain host costs. On a GPU an engine without the step
pipeline pays them on top of every device step; the pipelined engine pays them while the device
runs the step in flight, so they cost nothing as long as they are shorter than that step.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
import types

import torch

from areal_async.embedded.engine.sampling import SamplingParams


class _FakeCache:
    def __init__(self, num_slots: int, max_seq_len: int):
        self.num_slots, self.max_seq_len, self.scratch_slot = num_slots, max_seq_len, num_slots

    def move(self, src: int, dst: int, length: int) -> None:
        pass


class FakeForward:
    """What ``Engine`` uses of ``BatchedForward``, returning constant logits at no compute cost."""

    def __init__(self, num_slots: int, max_seq_len: int, vocab: int):
        self.cache = _FakeCache(num_slots, max_seq_len)
        self.embed = types.SimpleNamespace(weight=torch.empty(vocab, 1))
        self.device = torch.device("cpu")
        self.logits = torch.zeros(num_slots, vocab)

    def decode_batch(self, tokens, positions) -> torch.Tensor:
        return self.logits[: len(positions)]

    def prefill(self, seqs: list[list[int]], slots: list[int]) -> torch.Tensor:
        return self.logits[: len(seqs)]

    def load_weights(self, tensors) -> None:
        pass


def tiny_forward(num_slots: int, max_seq_len: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_async.embedded.engine.forward import BatchedForward

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    return BatchedForward(model.eval().requires_grad_(False), num_slots, max_seq_len)


def load_engine_class(path: str | None):
    if path is None:
        from areal_async.embedded.engine.engine import Engine

        return Engine
    # a sibling module name, so the copy's relative imports (.forward, ..jitter) resolve
    spec = importlib.util.spec_from_file_location("areal_async.embedded.engine._bench_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Engine


async def one_run(engine_cls, forward, args) -> dict[str, float]:
    engine = engine_cls(forward, set(), max_prefill_tokens=args.requests * args.prompt_len)
    spent = {"_plan": 0.0, "_commit": 0.0}
    steps = 0

    def timed(name):
        inner = getattr(engine, name)

        def wrapper(*a):
            nonlocal steps
            start = time.perf_counter()
            try:
                return inner(*a)
            finally:
                spent[name] += time.perf_counter() - start
                steps += name == "_commit"

        setattr(engine, name, wrapper)

    timed("_plan")
    timed("_commit")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (args.requests, args.prompt_len), generator=g).tolist()
    task = asyncio.create_task(engine.run())
    start = time.perf_counter()
    done = await asyncio.gather(*(
        engine.generate(p, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, sampling_seed=i), f"r{i}")
        for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert all(len(c.output_ids) == args.new_tokens for c in done)
    us = 1e6 / steps
    return {"steps": steps, "total": seconds * us, "plan": spent["_plan"] * us, "commit": spent["_commit"] * us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--forward", choices=["fake", "tiny"], default="fake")
    parser.add_argument("--engine-file", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine_cls = load_engine_class(args.engine_file)
    max_seq_len = args.prompt_len + args.new_tokens
    runs = []
    for _ in range(args.repeats):
        if args.forward == "fake":
            forward = FakeForward(args.requests, max_seq_len, args.vocab)
        else:
            forward = tiny_forward(args.requests, max_seq_len, args.vocab)
            if args.engine_file:  # an older engine passes token lists: put them on the device first
                decode = forward.decode_batch
                forward.decode_batch = lambda tokens, positions: decode(torch.as_tensor(tokens), positions)
        runs.append(asyncio.run(one_run(engine_cls, forward, args)))
    best = min(runs, key=lambda r: r["total"])
    print(f"engine {args.engine_file or 'areal_async.embedded.engine.engine'}, forward {args.forward}, "
          f"{args.requests} requests x {args.new_tokens} tokens, {best['steps']} steps; best of {args.repeats}")
    print(f"  us/step: total {best['total']:.0f}  plan {best['plan']:.0f}  commit {best['commit']:.0f}  "
          f"rest (launch, sampling, collect) {best['total'] - best['plan'] - best['commit']:.0f}  "
          f"(median total {statistics.median(r['total'] for r in runs):.0f})")


if __name__ == "__main__":
    main()
