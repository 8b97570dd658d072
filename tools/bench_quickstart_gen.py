"""Generation time of the CPU quickstart's two waits, prompt reuse on against off, interleaved.

Starts two embedded servers in this process on the quickstart's model, dtype and limits (one with
the prefix cache, one with ``--disable-radix-cache``), then, per round and per server (the order
alternates between rounds): one training step's rollouts exactly as the generation worker sends
them (``rollout.worker.GenerationWorker._run_sample``'s requests: 8 groups × 4 samples, temperature
1, seeds ``sample_seed(seed, g, i)``, one HTTP request per sample) and the start-of-run evaluation
(``rollout.eval.evaluate``: 60 greedy prompts). Each is preceded by ``/flush_cache``, as the
weight update before every step and a fresh server before the first evaluation leave the cache.
Prints per phase the seconds, the time in prefill and decode forwards, the prompt tokens computed
and the prompts per prefill forward, and whether both servers gave the same rollout tokens and the
same evaluation pass@1 and mean length.

    python tools/bench_quickstart_gen.py [--config configs/quickstart_cpu.yaml] [--dtype float32]
        [--threads 1] [--rounds 2]

``--threads 1`` is what the launcher gives the server on a 2-core machine (cores // (servers +
trainer ranks)).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch

from areal_async.config import load_config
from areal_async.data import load_task
from areal_async.data.prompts import PromptSet
from areal_async.inference.client import InferenceClient
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.model.source import resolve_model_path
from areal_async.reward.pool import RewardPool
from areal_async.rollout.eval import evaluate
from areal_async.types import sample_seed


class Counted:
    """Wraps an engine's forward calls: prompt tokens computed, prompts per prefill forward, and
    seconds in prefill and in decode forwards (on CPU each call returns when its work is done)."""

    def __init__(self, engine):
        self.reset()
        prefill, decode = engine.forward.prefill, engine.forward.decode_batch

        def counted_prefill(seqs, slots, starts=None):
            start = time.perf_counter()
            out = prefill(seqs, slots, starts)
            self.prefill_s += time.perf_counter() - start
            self.computed += sum(map(len, seqs)) - sum(starts or [])
            self.calls.append(len(seqs))
            return out

        def counted_decode(tokens, positions):
            start = time.perf_counter()
            out = decode(tokens, positions)
            self.decode_s += time.perf_counter() - start
            self.decode_steps += 1
            return out

        engine.forward.prefill, engine.forward.decode_batch = counted_prefill, counted_decode

    def reset(self) -> None:
        self.computed, self.calls, self.prefill_s, self.decode_s, self.decode_steps = 0, [], 0.0, 0.0, 0

    def __str__(self) -> str:
        return (f"prefill {self.prefill_s:.1f} s ({self.computed} prompt tokens computed, prompts per forward "
                f"{self.calls}), decode {self.decode_s:.1f} s ({self.decode_steps} steps)")


async def rollout_step(client, prompts: PromptSet, cfg, step: int):
    """One step's groups as the worker sends them; returns the results in (group, sample) order."""
    r = cfg.rollout
    calls = []
    for g in range(step * cfg.queue.batch_size, (step + 1) * cfg.queue.batch_size):
        item = prompts.for_group(g)
        for i in range(r.n_samples):
            sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                        "max_new_tokens": r.max_new_tokens, "sampling_seed": sample_seed(cfg.seed, g, i),
                        "stop_token_ids": prompts.stop_token_ids}
            calls.append(client.generate(item.prompt_ids, sampling, rid=f"g{g}-s{i}"))
    return await asyncio.gather(*calls)


async def bench(args) -> None:
    cfg = load_config(args.config)
    path = str(resolve_model_path(cfg.model))
    inf = cfg.inference
    servers, counters = {}, {}
    for name, cache in (("reuse on", True), ("reuse off", False)):
        engine, tokenizer = load_engine(path, args.dtype, "cpu", inf.max_running_requests, inf.max_seq_len,
                                        prefix_cache=cache)
        servers[name], counters[name] = InferenceServer(engine, tokenizer, path), Counted(engine)
    train = PromptSet(load_task(cfg.data, "train"), tokenizer, cfg.data.max_prompt_len, cfg.seed)
    test = PromptSet(load_task(cfg.data, "test"), tokenizer, cfg.data.max_prompt_len, cfg.seed)
    rows, outputs = [], {}
    async with serve(servers["reuse on"]) as on_url, serve(servers["reuse off"]) as off_url:
        urls = {"reuse on": on_url, "reuse off": off_url}
        with RewardPool(cfg.reward) as rewards:
            for rnd in range(args.rounds):
                order = list(urls) if rnd % 2 == 0 else list(urls)[::-1]
                for name in order:
                    async with InferenceClient([urls[name]], timeout_s=inf.request_timeout_s) as client:
                        for phase in ("rollout", "eval"):
                            await client.flush_cache()
                            counters[name].reset()
                            start = time.perf_counter()
                            if phase == "rollout":
                                out = await rollout_step(client, train, cfg, rnd)
                                tokens = [o.output_ids for o in out]
                            else:
                                out = await evaluate(client, test, rewards, cfg.eval.num_prompts,
                                                     cfg.eval.max_new_tokens)
                                tokens = (out["eval/pass@1"], out["eval/response_len"])
                            seconds = time.perf_counter() - start
                            outputs[(rnd, name, phase)] = tokens
                            rows.append((rnd, name, phase, seconds))
                            print(f"round {rnd} {name:<9} {phase:<7} {seconds:6.1f} s: {counters[name]}", flush=True)
    print(f"\n{path} {args.dtype}, {args.threads} thread(s), {args.rounds} rounds")
    print(f"{'phase':<8} {'reuse on s':>11} {'reuse off s':>12} {'off / on':>9} {'same output':>12}")
    for phase in ("rollout", "eval"):
        on = [s for _, n, p, s in rows if n == "reuse on" and p == phase]
        off = [s for _, n, p, s in rows if n == "reuse off" and p == phase]
        same = all(outputs[(r, "reuse on", phase)] == outputs[(r, "reuse off", phase)] for r in range(args.rounds))
        print(f"{phase:<8} {np.mean(on):>11.1f} {np.mean(off):>12.1f} {np.mean(off) / np.mean(on):>9.2f} {str(same):>12}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart_cpu.yaml")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
