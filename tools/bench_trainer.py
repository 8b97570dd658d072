"""Seconds per training step of the trainer on synthetic rollouts of a given shape.

    python tools/bench_trainer.py --model DIR [--groups 8 --n-samples 4 --prompt-len 150
        --response-len 200 --steps 3 --dtype float32]
    torchrun --nproc-per-node 2 tools/bench_trainer.py --model DIR ...   # 2 gloo ranks

Runs ``train_step`` (packing, decoupled-PPO forward/backward, AdamW) on random token ids with
random behaviour log-probs and ±5 rewards, then one full-parameter gather as the weight sync
does. Prints per-step seconds, trained tokens/s and the peak RSS of rank 0. The first step is
reported separately (warm-up).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
import torch.distributed as dist

from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.parallel import build_policy, full_parameters, hf_model, init_distributed
from areal_async.trainer.step import train_step
from areal_async.types import Array, Sample, Trajectory


def synthetic_batch(groups: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        samples = []
        for i in range(n):
            length = int(rng.integers(response_len // 2, response_len + 1))
            samples.append(Sample(
                index=i, seed=i, output_ids=Array.of(rng.integers(0, vocab, length), "int32"),
                behav_logprobs=Array.of(-rng.uniform(0.1, 3.0, length), "float32"),
                versions=Array.of(np.zeros(length), "int32"), finish_reason="stop",
                reward=5.0 if rng.random() < 0.5 else -5.0))
        out.append(Trajectory(group_id=g, prompt_ids=Array.of(rng.integers(0, vocab, prompt_len), "int32"),
                              samples=samples, data_index=g))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--response-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens-per-mb", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"])
    args = ap.parse_args()
    device = init_distributed("auto")
    cfg = TrainerConfig(max_tokens_per_mb=args.max_tokens_per_mb, dtype=args.dtype, parallel=args.parallel, lr=1e-6)
    policy = build_policy(args.model, cfg, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    vocab = hf_model(policy).config.vocab_size
    rank = dist.get_rank()
    for step in range(args.steps):
        batch = synthetic_batch(args.groups, args.n_samples, args.prompt_len, args.response_len, vocab, step)
        t0 = time.perf_counter()
        m = train_step(policy, optimizer, batch, AlgoConfig(), cfg, 1.0, device)
        t1 = time.perf_counter()
        for _ in full_parameters(policy):
            pass
        t2 = time.perf_counter()
        if rank == 0:
            print(f"step {step}: train {t1 - t0:.2f} s ({m['train/tokens'] / (t1 - t0):.0f} tok/s, "
                  f"{int(m['train/tokens'])} tokens), gather {t2 - t1:.2f} s, loss {m['train/loss']:+.4f}, "
                  f"grad_norm {m['train/grad_norm']:.3f}", flush=True)
    if rank == 0:
        print(f"peak RSS rank 0: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB "
              f"(world size {dist.get_world_size()}, {torch.get_num_threads()} threads)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
