"""Trainer forward+backward throughput on RL-like lengths: packed varlen vs padded, on one GPU.

    python tools/bench_gpu_trainer.py [--shape 0.6b] [--num-seqs 64] [--min-len 64 --max-len 2048]
        [--max-tokens-per-mb 16384] [--padded-mb 8] [--chunks 256 1024 0] [--json out.json]

Workload: ``--num-seqs`` sequences of random tokens with lengths uniform in [min, max] (seed 0);
loss = -mean next-token log-prob (the shape of the PPO loss's heavy part: one forward, the LM
head, log-softmax, one backward); no optimizer step. Weights are fp32 master weights; compute is
bf16 (``torch.autocast``, the project's single-rank wrapper), or FSDP2 with bf16 parameters and fp32
gradient reduction for the ``fsdp2`` row (one rank).

Variants:
- ``padded``: micro-batches of ``--padded-mb`` sequences in their given order, right-padded to the
  longest, HF ``sdpa`` attention with the padding mask; the LM head + log-softmax run chunked on the
  real tokens only (the same code as packed), so the difference is attention and padding.
- ``packed``: first-fit-decreasing micro-batches of at most ``--max-tokens-per-mb`` tokens, one 1D
  row each, ``varlen_attn`` (``trainer/attention.py``), log-probs chunked by ``chunk`` rows of the
  ``[T, vocab]`` logits (``0`` = the whole micro-batch at once, i.e. unchunked).

FLOPs (model FLOPs of the real tokens; padding and recomputation are not counted):
``6 · N · T + 6 · layers · heads · head_dim · Σ L_b²``, N = all parameters with the tied
embedding counted once (as the LM head matmul), T = Σ L_b. The attention term is causal: per layer
the forward's QKᵀ and PV cost 2 · 2 · L² · H · D / 2, and the backward twice the forward. MFU is
against the H200's dense bf16 datasheet rate (989 TFLOP/s; ~800 measured on a large matmul).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.logprobs import PackedPolicy, _head_logp
from areal_async.trainer.packing import allocate_micro_batches, pack_sequences
from qwen3_shapes import build_model

PEAK_FLOPS = 989e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunked_logp(lm, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    chunk = chunk or hidden.shape[0]
    parts = [checkpoint(_head_logp, lm.lm_head, hidden[s : s + chunk], labels[s : s + chunk], 1.0,
                        use_reentrant=False)[0] for s in range(0, hidden.shape[0], chunk)]
    return torch.cat(parts)


def packed_step(policy, seqs, mbs, chunk, device, total_tokens: int) -> None:
    for mb in mbs:
        batch = pack_sequences([seqs[i] for i in mb]).to(device)
        logp, _ = policy(batch, 1.0, chunk or batch.num_tokens)
        (-logp.sum() / total_tokens).backward()


def padded_step(lm, seqs, mb_size, chunk, device, total_tokens: int, dtype) -> None:
    for s in range(0, len(seqs), mb_size):
        group = seqs[s : s + mb_size]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        for b, seq in enumerate(group):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        labels = torch.roll(ids, -1, dims=1)
        valid = mask.bool() & (torch.arange(width, device=device)[None] < mask.sum(1, keepdim=True) - 1)
        with torch.autocast(device.type, dtype=dtype):
            hidden = lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            logp = _chunked_logp(lm, hidden[valid], labels[valid], chunk)
        (-logp.sum() / total_tokens).backward()


def measure(fn, reps: int, device) -> tuple[float, float]:
    """Seconds per call (median of ``reps`` after one warm-up) and peak GiB allocated."""
    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return float(np.median(times)), peak


def profile(fn, device, top: int = 18) -> None:
    """One iteration under ``torch.profiler``: the CUDA kernels with the most total time, and the
    share of the wall time any kernel ran."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    _sync(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    print(f"\nprofile: wall {wall:.2f} s (profiled), kernels busy {busy:.2f} s ({busy / wall:.0%}), {launches} launches")
    for e in kernels[:top]:
        share = e.self_device_time_total / 1e6 / wall
        print(f"{e.self_device_time_total / 1e3:>9.1f} ms {share:>6.1%} {e.count:>6}x  {e.key[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-tokens-per-mb", type=int, default=16384)
    ap.add_argument("--padded-mb", type=int, default=8)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 0], help="0: unchunked")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsdp2", action="store_true", help="also time the packed path under one-rank FSDP2")
    ap.add_argument("--fused-norm", action="store_true",
                    help="with --fsdp2: time it again with every RMSNorm as F.rms_norm (the trainer's CUDA default)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the last variant's iteration")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    lm = build_model(args.shape, torch.float32, device)
    lm.config.use_cache = False
    cfg = lm.config
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_seqs).tolist()
    seqs = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    tokens = sum(lengths)
    n_params = sum(p.numel() for p in lm.parameters())
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in lengths)
    flops = 6 * n_params * tokens + attn
    mbs = allocate_micro_batches(lengths, args.max_tokens_per_mb)
    rows = []

    def record(name, chunk, fn):
        lm.zero_grad(set_to_none=True)
        seconds, peak = measure(fn, args.reps, device)
        lm.zero_grad(set_to_none=True)
        rows.append({"variant": name, "chunk": chunk, "seconds": seconds, "tok_s": tokens / seconds,
                     "tflops": flops / seconds / 1e12, "mfu": flops / seconds / PEAK_FLOPS, "peak_gib": peak})
        print(json.dumps(rows[-1]), flush=True)

    lm.set_attn_implementation("sdpa")
    record("padded sdpa", 256, lambda: padded_step(lm, seqs, args.padded_mb, 256, device, tokens, dtype))
    use_packed_attention(lm)
    policy = PackedPolicy(lm, autocast_dtype=dtype)
    for chunk in args.chunks:
        record("packed varlen", chunk, lambda: packed_step(policy, seqs, mbs, chunk, device, tokens))
    if args.fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from areal_async.trainer.parallel import init_distributed

        init_distributed(device.type)
        policy = PackedPolicy(lm)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in lm.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(policy, mp_policy=mp)
        chunk = args.chunks[0]
        record("packed fsdp2", chunk, lambda: packed_step(policy, seqs, mbs, chunk, device, tokens))
        if args.fused_norm:
            from areal_async.trainer.parallel import use_fused_rms_norm

            use_fused_rms_norm(lm)
            record("fsdp2 fusednorm", chunk, lambda: packed_step(policy, seqs, mbs, chunk, device, tokens))
        if args.profile:
            profile(lambda: packed_step(policy, seqs, mbs, chunk, device, tokens), device)
        torch.distributed.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "tokens": tokens, "params": n_params, "flops": flops, "rows": rows}, f, indent=1)

    print(f"\n{args.shape} (fp32 master weights, bf16 compute), {args.num_seqs} seqs, lengths uniform "
          f"{args.min_len}-{args.max_len}, {tokens} tokens, {len(mbs)} packed micro-batches of <= "
          f"{args.max_tokens_per_mb} tokens; padded micro-batches of {args.padded_mb} seqs")
    print(f"FLOPs/iteration: 6*N*T = {6 * n_params * tokens / 1e12:.1f} T + attention {attn / 1e12:.1f} T "
          f"(N = {n_params / 1e6:.0f}M)")
    print(f"{'variant':<14} {'chunk':>6} {'seconds':>8} {'tok/s':>8} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    base = rows[0]["tok_s"]
    for r in rows:
        chunk = r["chunk"] or "all"
        print(f"{r['variant']:<14} {chunk:>6} {r['seconds']:>8.2f} {r['tok_s']:>8.0f} {r['tflops']:>8.1f} "
              f"{r['mfu']:>6.1%} {r['peak_gib']:>9.1f}   {r['tok_s'] / base:.2f}x padded")


if __name__ == "__main__":
    main()
