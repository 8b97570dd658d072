"""Prefix-cache hit rate and prefill work of multi-turn episodes, reuse on against off.

Starts embedded servers in this process (the tests' tiny random Llama, 2 layers, hidden 64, fp32,
unless ``--model-path``), and runs the same episodes through real HTTP and ``InferenceClient``
under three setups: the prefix cache off (``--disable-radix-cache``); on, with calls routed without
a key (round-robin over the servers, as single-turn rollouts are); on, with each episode's calls
carrying its id as the session key (``ServerPool.route_session``; ``--key group``: its group's id,
so a group's episodes share one server and their item's prompt). An episode is ``--turns`` turns:
turn 1's prompt is its group's item (``--prompt-tokens`` ids; ``--samples`` episodes per item, as a
GRPO group), turn t+1's prompt is turn t's prompt + its sampled tokens (``--new-tokens``, temperature
1, a seed per episode and turn, EOS ignored) + ``--obs-tokens`` new observation ids. Turns run in
lockstep: every episode's turn t at once, then turn t+1. The servers' caches are flushed first.

Prints, per setup and turn: prompt tokens, tokens served from the cache (``meta_info.cached_tokens``),
tokens the prefill forwards computed (counted at the forward), the hit rate, and the turn's wall
seconds; then the hit rate of turns >= 2 (the issue's ``rollout/prefix_cache_hit``) and whether
every sampled token equals the reuse-off run's. ``--deterministic``: the servers run in
deterministic mode (only same-step twins are reused there; docs/engine.md).

    python tools/bench_turn_cache.py [--servers 3] [--groups 2] [--samples 4] [--turns 4]
        [--prompt-tokens 200] [--new-tokens 32] [--obs-tokens 24] [--threads 1] [--entries 8]
        [--key episode|group] [--deterministic]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import tempfile
import time

import numpy as np
import torch

from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.inference.client import InferenceClient


class PrefillCount:
    """Counts the prompt tokens an engine's prefill forwards compute (copied ones excluded)."""

    def __init__(self, engine):
        self.computed = 0
        prefill = engine.forward.prefill

        def counted(seqs, slots, starts=None):
            self.computed += sum(map(len, seqs)) - sum(starts or [])
            return prefill(seqs, slots, starts)

        engine.forward.prefill = counted


def episode_items(args, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each group's turn-1 prompt, and each episode's observation ids after turns 1 .. T-1."""
    rng = np.random.default_rng(0)
    items = [rng.integers(3, vocab, args.prompt_tokens).tolist() for _ in range(args.groups)]
    obs = [[rng.integers(3, vocab, args.obs_tokens).tolist() for _ in range(args.turns - 1)]
           for _ in range(args.groups * args.samples)]
    return items, obs


async def run_setup(args, model: str, reuse: bool, sticky: bool) -> list[dict]:
    """One setup's episodes; returns per turn ``{prompt, cached, computed, seconds, outputs}``."""
    engines = [load_engine(model, args.dtype, "cpu", args.slots, args.max_seq_len, deterministic=args.deterministic,
                           prefix_cache=reuse, prefix_cache_entries=args.entries) for _ in range(args.servers)]
    counts = [PrefillCount(e) for e, _ in engines]
    servers = [InferenceServer(e, tok, model) for e, tok in engines]
    vocab = engines[0][0].vocab_size
    items, obs = episode_items(args, vocab)
    tasks = [asyncio.create_task(e.run()) for e, _ in engines]
    key = (lambda k: f"e{k}") if args.key == "episode" else (lambda k: f"g{k // args.samples}")
    turns = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serve(server)) for server in servers]
            client = await stack.enter_async_context(InferenceClient(urls))
            await client.flush_cache()
            n = args.groups * args.samples
            prompts = [items[k // args.samples] for k in range(n)]
            for t in range(args.turns):
                before = sum(c.computed for c in counts)
                start = time.perf_counter()
                outs = await asyncio.gather(*(
                    client.generate(prompts[k], {"max_new_tokens": args.new_tokens, "temperature": 1.0,
                                                 "ignore_eos": True, "sampling_seed": 1000 * k + t},
                                    f"e{k}-t{t}", session=key(k) if sticky else None)
                    for k in range(n)))
                seconds = time.perf_counter() - start
                turns.append({"prompt": sum(map(len, prompts)),
                              "cached": sum(o.cached_tokens for o in outs),
                              "computed": sum(c.computed for c in counts) - before, "seconds": seconds,
                              "outputs": [o.output_ids for o in outs]})
                if t + 1 < args.turns:
                    prompts = [prompts[k] + outs[k].output_ids + obs[k][t] for k in range(n)]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="an HF directory (default: the tests' tiny random Llama)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--obs-tokens", type=int, default=24)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--entries", type=int, default=8, help="prefix cache rows per server")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--key", choices=["episode", "group"], default="episode",
                   help="the session key: each episode's id, or its group's (a group's episodes on one server)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path
        if model is None:
            from tests.support.models import build_tiny_model
            model = str(build_tiny_model(pathlib.Path(tmp) / "tiny-llama"))
        setups = [("reuse off", False, False), ("reuse on, no key", True, False), ("reuse on, session key", True, True)]
        results = {name: asyncio.run(run_setup(args, model, reuse, sticky)) for name, reuse, sticky in setups}
    reference = [t["outputs"] for t in results["reuse off"]]
    print(f"{args.servers} servers, {args.groups} groups x {args.samples} episodes, {args.turns} turns, "
          f"prompt {args.prompt_tokens} + {args.new_tokens} new + {args.obs_tokens} observation tokens per turn, "
          f"{args.entries} cache rows, {args.threads} thread(s), {args.dtype}"
          f"{', deterministic' if args.deterministic else ''}, session key: {args.key}")
    print(f"{'setup':<24} {'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>8} {'hit':>6} {'s':>6}")
    for name, turns in results.items():
        for t, r in enumerate(turns):
            print(f"{name:<24} {t + 1:>4} {r['prompt']:>7} {r['cached']:>7} {r['computed']:>8} "
                  f"{r['cached'] / r['prompt']:>6.3f} {r['seconds']:>6.2f}")
        later = turns[1:]
        hit = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
        same = [t["outputs"] for t in turns] == reference
        print(f"{name:<24} turns >= 2: hit rate {hit:.3f}, computed {sum(r['computed'] for r in later)} of "
              f"{sum(r['prompt'] for r in later)} prompt tokens, {sum(r['seconds'] for r in later):.2f} s; "
              f"all tokens as reuse off: {same}")


if __name__ == "__main__":
    main()
