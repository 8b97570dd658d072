"""Cost of the embedded engine's deterministic (batch-invariant) mode: output tokens/s with and
without ``--enable-deterministic-inference``, at several concurrencies, in-process (no HTTP).

    python tools/measure_determinism.py --model-path DIR [--dtype bfloat16] [--threads 2]
        [--new-tokens 64] [--concurrency 1 8 32]

Every request is sampled (temperature 1, its own seed, ``ignore_eos``), so each makes exactly
``--new-tokens`` tokens; both modes run the same requests. Prints one row per (mode, concurrency)
and the slowdown (throughput tok/s / deterministic tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine


async def _tokens_per_s(args, deterministic: bool, n: int) -> tuple[float, list[list[int]]]:
    engine, tokenizer = load_engine(args.model_path, args.dtype, "cpu", n, args.max_seq_len,
                                    deterministic=deterministic)
    task = asyncio.create_task(engine.run())
    prompts = [tokenizer(f"Question {i}: Natalia sold clips to {i + 3} friends. How many in all?",
                         add_special_tokens=False)["input_ids"] for i in range(n)]
    warm = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, sampling_seed=0)
    await engine.generate(prompts[0], warm, "warmup")
    start = time.perf_counter()
    done = await asyncio.gather(*(
        engine.generate(p, SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0,
                                          ignore_eos=True, sampling_seed=i), f"r{i}")
        for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return sum(len(c.output_ids) for c in done) / seconds, [c.output_ids for c in done]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model_path} {args.dtype}, {args.threads} threads, {args.new_tokens} new tokens/request")
    print(f"{'concurrent':>10} {'throughput tok/s':>17} {'deterministic tok/s':>20} {'slowdown':>9}")
    for n in args.concurrency:
        fast, _ = asyncio.run(_tokens_per_s(args, False, n))
        det, _ = asyncio.run(_tokens_per_s(args, True, n))
        print(f"{n:>10} {fast:>17.1f} {det:>20.1f} {fast / det:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
