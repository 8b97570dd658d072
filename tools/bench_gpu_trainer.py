"""Trainer forward+backward throughput on RL-like lengths: packed varlen vs padded, on one GPU.

    python tools/bench_gpu_trainer.py [--shape 0.6b] [--num-seqs 64] [--min-len 64 --max-len 2048]
        [--max-tokens-per-mb 16384] [--padded-mb 8] [--chunks 256 1024 0] [--json out.json]
        [--fsdp2 [--fused-norm]] [--variants base,mb32k,gqa,fusedhead,compile,all+mb32k]
        [--skip-autocast] [--check] [--profile]

    # each idea alone and together, one process (the variant table is printed at the end):
    python tools/bench_gpu_trainer.py --skip-autocast --chunks 1024 --check
        --variants base,mb32k,mb64k,gqa,fusedhead,headcompile,compile,all,all+mb32k,all+mb64k

Workload: ``--num-seqs`` sequences of random tokens with lengths uniform in [min, max] (seed 0);
loss = -mean next-token log-prob (the shape of the PPO loss's heavy part: one forward, the LM
head, log-softmax, one backward); no optimizer step. Weights are fp32 master weights; compute is
bf16 (``torch.autocast``, the project's single-rank wrapper), or FSDP2 with bf16 parameters and fp32
gradient reduction for the ``fsdp2`` row (one rank).

Variants:
- ``padded``: micro-batches of ``--padded-mb`` sequences in their given order, right-padded to the
  longest, HF ``sdpa`` attention with the padding mask; the LM head + log-softmax run chunked on the
  real tokens only (the same code as packed), so the difference is attention and padding.
- ``packed``: micro-batches of at most ``--max-tokens-per-mb`` tokens (``packing.allocate_micro_batches``:
  as few as first-fit-decreasing needs, balanced; before round 4, first-fit-decreasing itself), one 1D
  row each, ``varlen_attn`` (``trainer/attention.py``), log-probs chunked by ``chunk`` rows of the
  ``[T, vocab]`` logits (``0`` = the whole micro-batch at once, i.e. unchunked).
  These rows, and the ``packed fsdp2`` / ``fsdp2 fusednorm`` rows, keep K/V repeated before
  ``varlen_attn`` and the checkpointed LM head, as measured before the fused head existed.
- ``--variants`` (the one-rank FSDP2 setup of ``--fsdp2``, every RMSNorm as ``F.rms_norm``): a
  comma-separated list; each variant is a ``+``-joined set of options over ``base`` (the
  ``fsdp2 fusednorm`` row's code paths):
  ``mbNk`` micro-batches of ≤ N·1024 tokens (default ``--max-tokens-per-mb``);
  ``cN`` LM-head chunks of N rows (default ``--chunks[0]``);
  ``gqa`` K/V with their own head count (8 for Qwen3-0.6B) into ``varlen_attn``, no
  ``repeat_interleave``;
  ``fusedhead`` the fused LM head + log-softmax autograd function (``trainer/packed_policy.py``);
  ``headcompile`` its per-chunk kernels compiled (implies ``fusedhead``);
  ``compile`` every decoder layer's ``forward`` through ``torch.compile``;
  ``triton`` the project's Triton attention kernels instead of ``varlen_attn``
  (``trainer.attention_backend: triton``; native GQA);
  ``padded`` micro-batches of ``--padded-mb`` sequences in their given order, right-padded, HF
  ``sdpa`` with the padding mask, the LM head on the real tokens only: everything else as the
  variant's other options say, so ``padded+fusedhead+headcompile+compile`` is the like-for-like
  padded twin of ``all`` (``mbNk``, ``gqa`` and ``triton`` do not apply to it);
  ``blockingh2d`` each micro-batch copied to the GPU from pageable memory (``.to(device)``
  synchronises the stream first), as the trainer did before ``packing.to_device``;
  ``all`` = ``gqa+fusedhead+headcompile+compile``. ``gqa+fusedhead`` is the trainer's CUDA
  default now (``build_policy``); ``all`` is ``trainer.compile: true``.
  All variants run on one FSDP2-sharded model: the options are switched between variants (the
  attention implementation name, ``PackedPolicy`` attributes, the layers' ``forward``), compiled
  code is kept. A variant that raises (compile error, out of memory) prints the error and the
  others still run. ``--check``: the attention paths (flash with native GQA, flash with K/V
  repeated, Triton) against an fp32 reference on random bf16 inputs, with their forward and
  backward times; then every packed variant's log-probs and gradients on the first micro-batch
  against ``base``. ``--profile``: the top kernels of the last variant's iteration, and where the
  GPU sat idle (gaps between kernels, by the host operation that launched the kernel after the gap).

FLOPs (model FLOPs of the real tokens; padding and recomputation are not counted):
``6 · N · T + 6 · layers · heads · head_dim · Σ L_b²``, N = all parameters with the tied
embedding counted once (as the LM head matmul), T = Σ L_b. The attention term is causal: per layer
the forward's QKᵀ and PV cost 2 · 2 · L² · H · D / 2, and the backward twice the forward. MFU is
against the H200's dense bf16 datasheet rate (989 TFLOP/s; ~800 measured on a large matmul).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
import traceback

import numpy as np
import torch

from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.packed_policy import PackedPolicy, _FusedHeadLogp, _head_logp
from areal_async.trainer.packing import allocate_micro_batches, pack_sequences
from gpu_timing import measure, profile
from qwen3_shapes import build_model

PEAK_FLOPS = 989e12
OPTIONS = ("gqa", "fusedhead", "headcompile", "compile")
EXTRA_OPTIONS = ("triton", "padded", "blockingh2d")


def _chunked_logp(lm, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    chunk = chunk or hidden.shape[0]
    parts = [checkpoint(_head_logp, lm.lm_head, hidden[s : s + chunk], labels[s : s + chunk], 1.0,
                        use_reentrant=False)[0] for s in range(0, hidden.shape[0], chunk)]
    return torch.cat(parts)


def packed_step(policy, seqs, mbs, chunk, device, total_tokens: int, non_blocking: bool | None = None) -> None:
    for mb in mbs:
        batch = pack_sequences([seqs[i] for i in mb]).to(device, non_blocking)
        logp, _ = policy(batch, 1.0, chunk or batch.num_tokens)
        (-logp.sum() / total_tokens).backward()


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """Sequences right-padded to the longest: ``ids``, ``mask`` ``[B, L] int64``; ``labels``
    ``[N] int64`` the next tokens of the ``N`` real positions that have one, at flat positions
    ``index`` ``[N] int64`` of the ``[B·L]`` hidden states."""

    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor

    @staticmethod
    def build(group: list[list[int]]) -> "PaddedBatch":
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        labels, index = [], []
        for b, seq in enumerate(group):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            labels += seq[1:]
            index += range(b * width, b * width + len(seq) - 1)
        return PaddedBatch(ids, mask, torch.tensor(labels), torch.tensor(index))

    def to(self, device, non_blocking: bool | None = None) -> "PaddedBatch":
        from areal_async.trainer.packing import to_device

        return PaddedBatch(*(to_device(t, device, non_blocking) for t in dataclasses.astuple(self)))


class BenchPolicy(PackedPolicy):
    """``PackedPolicy`` whose ``forward`` also takes a ``PaddedBatch`` (the ``padded`` variants), so
    that FSDP2's root hooks gather the embeddings and the head around both kinds of micro-batch."""

    def forward(self, batch, temperature: float = 1.0, chunk_tokens: int = 1024):
        if not isinstance(batch, PaddedBatch):
            return super().forward(batch, temperature, chunk_tokens)
        hidden = self.lm.model(input_ids=batch.ids, attention_mask=batch.mask, use_cache=False).last_hidden_state
        h = hidden.flatten(0, 1).index_select(0, batch.index)  # real positions only, no host sync
        if self.fused_head:
            return _FusedHeadLogp.apply(h, self.lm.lm_head.weight, batch.labels, temperature, chunk_tokens, h.dtype,
                                        self.head_kernels)
        return self._checkpointed_head(h, batch.labels, temperature, chunk_tokens)


def padded_policy_step(policy, seqs, mb_size, chunk, device, total_tokens: int,
                       non_blocking: bool | None = None) -> None:
    for s in range(0, len(seqs), mb_size):
        batch = PaddedBatch.build(seqs[s : s + mb_size]).to(device, non_blocking)
        logp, _ = policy(batch, 1.0, chunk)
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


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``--variants`` entry: the micro-batch budget and the switched-on options."""

    name: str
    max_tokens_per_mb: int
    chunk: int
    options: frozenset[str]


def parse_variants(spec: str, default_mb: int, default_chunk: int) -> list[Variant]:
    """``"base,mb32k,gqa+compile,all+mb64k+c2048"`` → ``Variant``s (see the module docstring)."""
    out = []
    for name in filter(None, (v.strip() for v in spec.split(","))):
        mb, chunk, options = default_mb, default_chunk, set()
        for token in name.split("+"):
            if token == "base":
                continue
            if token == "all":
                options |= set(OPTIONS)
            elif token.startswith("mb") and token.endswith("k") and token[2:-1].isdigit():
                mb = int(token[2:-1]) * 1024
            elif token.startswith("c") and token[1:].isdigit():
                chunk = int(token[1:])
            elif token in OPTIONS + EXTRA_OPTIONS:
                options.add(token)
            else:
                raise ValueError(f"unknown variant option {token!r} in {name!r}; use base, all, mbNk, cN or one of "
                                 f"{', '.join(OPTIONS + EXTRA_OPTIONS)} joined by '+'")
        if "headcompile" in options:
            options.add("fusedhead")
        out.append(Variant(name, mb, chunk, frozenset(options)))
    return out


class Switches:
    """Switches the options of ``Variant``s on one (FSDP2-sharded) ``PackedPolicy``; compiled
    layer forwards and head kernels are built once and kept."""

    def __init__(self, policy: PackedPolicy):
        from areal_async.trainer.policy import compile_decoder_layers

        self.policy, self.lm = policy, policy.lm
        self.eager_kernels = policy.head_kernels
        self.compiled_kernels = PackedPolicy(self.lm, compile_head=True).head_kernels
        compile_decoder_layers(self.lm)  # lazy: nothing compiles before the first call
        self.compiled_forwards = [vars(layer).pop("forward") for layer in self.lm.model.layers]

    def apply(self, options: frozenset[str]) -> None:
        if "padded" in options:
            self.lm.set_attn_implementation("sdpa")
        else:
            use_packed_attention(self.lm, native_gqa="gqa" in options, backend="triton" if "triton" in options else "flash")
        self.policy.fused_head = "fusedhead" in options
        self.policy.head_kernels = self.compiled_kernels if "headcompile" in options else self.eager_kernels
        for layer, compiled in zip(self.lm.model.layers, self.compiled_forwards):
            if "compile" in options:
                layer.forward = compiled
            else:
                vars(layer).pop("forward", None)


def _free_memory(lm) -> None:
    lm.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def check_attention(device, lengths: list[int], heads: int, kv_heads: int, head_dim: int, reps: int = 5) -> None:
    """The packed attention paths on one micro-batch's boundaries (bf16 random inputs): flash
    ``varlen_attn`` with native GQA, with K/V repeated, and the Triton kernels. Prints each
    one's max |Δ| against an fp32 per-sequence ``sdpa`` reference (output and dQ/dK/dV), and its
    forward and forward+backward times (median of ``reps``) with TFLOP/s on the causal FLOPs
    (forward ``2 · H · D · Σ L²``, backward twice that, as the MFU count)."""
    from areal_async.trainer.attention import packed_attention

    torch.manual_seed(0)
    n = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    kw = {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}
    q = torch.randn(1, heads, n, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, n, heads, head_dim, device=device, dtype=torch.bfloat16)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = packed_attention(torch.nn.Module(), *ref_in, None, head_dim**-0.5, **kw)  # fp32: sdpa path
    ref = (ref_out, *torch.autograd.grad(ref_out, ref_in, grad_out.float()))
    fwd_flops = 2 * heads * head_dim * sum(n_ * n_ for n_ in lengths)
    print(f"packed attention, {n} tokens in {len(lengths)} seqs, {heads} q / {kv_heads} kv heads; "
          f"max |Δ| against fp32 (max |out| {float(ref[0].detach().abs().max()):.3g}, |dQ| {float(ref[1].abs().max()):.3g}):")
    for name, extra in (("flash, native GQA", {}), ("flash, K/V repeated", {"native_gqa": False}),
                        ("triton", {"backend": "triton"})):
        try:
            def fwd():
                return packed_attention(torch.nn.Module(), q, k, v, None, head_dim**-0.5, **extra, **kw)[0]

            out = fwd()
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            diffs = [float((a.detach().float() - b.float()).abs().max()) for a, b in zip((out, *grads), ref)]

            def fwd_bwd():
                torch.autograd.grad(fwd(), (q, k, v), grad_out)

            times = [measure(fn, reps, device)[0] for fn in (lambda: fwd().detach(), fwd_bwd)]
            print(f"  {name:<20} out {diffs[0]:.3g}, dQ {diffs[1]:.3g}, dK {diffs[2]:.3g}, dV {diffs[3]:.3g}; "
                  f"forward {times[0] * 1e3:.2f} ms ({fwd_flops / times[0] / 1e12:.0f} TFLOP/s), forward+backward "
                  f"{times[1] * 1e3:.2f} ms ({3 * fwd_flops / times[1] / 1e12:.0f} TFLOP/s)", flush=True)
        except Exception as exc:  # report and check the others
            print(f"  {name:<20} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    if device.type == "cuda":
        try:
            sweep_triton_configs(q, k, v, cu, max(lengths), grad_out, fwd_flops, reps)
        except Exception as exc:
            print(f"  Triton config sweep FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


TRITON_SWEEP = {
    "FWD_CONFIG": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)],
    "DKDV_CONFIG": [(64, 128, 8, 2), (32, 128, 4, 2), (64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 3)],
    "DQ_CONFIG": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
}


def sweep_triton_configs(q, k, v, cu, max_len: int, grad_out, fwd_flops: float, reps: int) -> None:
    """Each Triton kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` choices of
    ``TRITON_SWEEP`` in turn (the other kernels at their current configs), timed on the same
    inputs; the fastest of each is kept in ``trainer.triton_packed_attention`` for the variants that
    follow, and printed."""
    from areal_async.trainer import triton_packed_attention as ta

    q3, k3, v3 = (t[0].transpose(0, 1).detach().requires_grad_() for t in (q, k, v))
    g3 = grad_out[0]

    def fwd():
        return ta.varlen_attention(q3, k3, v3, cu, max_len)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (q3, k3, v3), g3)

    for name, configs in TRITON_SWEEP.items():
        results = []
        for config in configs:
            setattr(ta, name, config)
            try:
                seconds = measure(fwd if name == "FWD_CONFIG" else fwd_bwd, reps, q.device)[0]
                results.append((seconds, config))
            except Exception as exc:  # e.g. out of shared memory
                print(f"  triton {name} {config}: FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        if not results:
            setattr(ta, name, configs[0])
            print(f"  triton {name}: every config failed; kept {configs[0]}", flush=True)
            continue
        results.sort()
        setattr(ta, name, results[0][1])
        flops = fwd_flops if name == "FWD_CONFIG" else 3 * fwd_flops
        what = "forward" if name == "FWD_CONFIG" else "forward+backward"
        print(f"  triton {name}: " + ", ".join(f"{c} {t * 1e3:.2f} ms" for t, c in results)
              + f" -> {results[0][1]} ({what} {flops / results[0][0] / 1e12:.0f} TFLOP/s)", flush=True)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖: bf16 rounding differences give ~1e-3, a wrong gradient O(1) (a max-norm
    would be dominated by single rounding flips of 2^-8 relative)."""
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def check_variants(policy, switches: Switches, variants: list[Variant], seqs, mb, chunk, device) -> None:
    """Log-probs and gradients of the first micro-batch under each variant against ``base``."""
    lm = policy.lm
    batch = pack_sequences([seqs[i] for i in mb]).to(device)
    last = lm.config.num_hidden_layers - 1
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
             f"model.layers.{last}.mlp.down_proj.weight"]

    def run(options):
        switches.apply(options)
        lm.zero_grad(set_to_none=True)
        logp, _ = policy(batch, 1.0, chunk)
        logp.sum().backward()
        params = dict(lm.named_parameters())
        grads = {n: (params[n].grad.full_tensor() if hasattr(params[n].grad, "full_tensor") else params[n].grad)
                 for n in names}
        return logp.detach().float(), {n: g.float().clone() for n, g in grads.items()}

    ref_logp, ref_grads = run(frozenset())
    print(f"checks on one micro-batch of {batch.num_tokens} tokens against base (max |logp| "
          f"{float(ref_logp.abs().max()):.3g}); gradients as ||Δ|| / ||g||:")
    for variant in variants:
        if not variant.options or "padded" in variant.options:  # a padded model sees other shapes
            continue
        try:
            logp, grads = run(variant.options)
            rel = ", ".join(f"{n.removeprefix('model.')} {_rel_diff(grads[n], ref_grads[n]):.2e}" for n in names)
            print(f"  {variant.name}: max |Δ logp| {float((logp - ref_logp).abs().max()):.3g}; {rel}", flush=True)
        except Exception as exc:  # keep checking the others
            print(f"  {variant.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            _free_memory(lm)
    lm.zero_grad(set_to_none=True)


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
    ap.add_argument("--variants", default="",
                    help="comma-separated FSDP2 variants, e.g. base,mb32k,gqa,fusedhead,compile,all+mb32k (see above)")
    ap.add_argument("--skip-autocast", action="store_true", help="skip the padded and autocast packed rows")
    ap.add_argument("--check", action="store_true", help="with --variants: numerical checks against base")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the last variant's iteration")
    ap.add_argument("--keep-unsharded", action="store_true",
                    help="FSDP2 reshard_after_forward=False: the backward reuses the forward's gathered bf16 "
                         "parameters instead of gathering them again (trainer.reshard_after_forward)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    variants = parse_variants(args.variants, args.max_tokens_per_mb, args.chunks[0])
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

    def record(name, chunk, fn, mb_tokens=args.max_tokens_per_mb, warmup=1):
        lm.zero_grad(set_to_none=True)
        seconds, peak = measure(fn, args.reps, device, warmup)
        lm.zero_grad(set_to_none=True)
        rows.append({"variant": name, "chunk": chunk, "seconds": seconds, "tok_s": tokens / seconds,
                     "tflops": flops / seconds / 1e12, "mfu": flops / seconds / PEAK_FLOPS, "peak_gib": peak,
                     "max_tokens_per_mb": mb_tokens})
        print(json.dumps(rows[-1]), flush=True)

    profile_fn = None
    if not args.skip_autocast:
        lm.set_attn_implementation("sdpa")
        record("padded sdpa", 256, lambda: padded_step(lm, seqs, args.padded_mb, 256, device, tokens, dtype), 0)
        use_packed_attention(lm, native_gqa=False)
        policy = PackedPolicy(lm, autocast_dtype=dtype, fused_head=False)
        for chunk in args.chunks:
            record("packed varlen", chunk, lambda: packed_step(policy, seqs, mbs, chunk, device, tokens))
    if args.fsdp2 or variants:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from areal_async.trainer.policy import init_distributed, use_fused_rms_norm

        init_distributed(device.type)
        use_packed_attention(lm, native_gqa=False)
        policy = BenchPolicy(lm, fused_head=False)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in lm.model.layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=not args.keep_unsharded)
        fully_shard(policy, mp_policy=mp, reshard_after_forward=not args.keep_unsharded)
        chunk = args.chunks[0]
        profile_fn = lambda: packed_step(policy, seqs, mbs, chunk, device, tokens)  # noqa: E731
        if args.fsdp2:
            record("packed fsdp2", chunk, profile_fn)
        if args.fused_norm or variants:
            use_fused_rms_norm(lm)
        if args.fsdp2 and args.fused_norm:
            record("fsdp2 fusednorm", chunk, profile_fn)
        if variants:
            run_variants(args, policy, variants, seqs, lengths, device, tokens, record, rows)
            profile_fn = variant_step(args, policy, variants[-1], seqs, lengths, device, tokens)
    if args.profile and profile_fn is not None:
        try:
            profile(profile_fn, device)
        except Exception as exc:  # the table below still prints
            print(f"profile FAILED {type(exc).__name__}: {exc}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "tokens": tokens, "params": n_params, "flops": flops, "rows": rows}, f, indent=1)

    print(f"\n{args.shape} (fp32 master weights, bf16 compute), {args.num_seqs} seqs, lengths uniform "
          f"{args.min_len}-{args.max_len}, {tokens} tokens, {len(mbs)} packed micro-batches of <= "
          f"{args.max_tokens_per_mb} tokens; padded micro-batches of {args.padded_mb} seqs")
    print(f"FLOPs/iteration: 6*N*T = {6 * n_params * tokens / 1e12:.1f} T + attention {attn / 1e12:.1f} T "
          f"(N = {n_params / 1e6:.0f}M)")
    width = max([14] + [len(r["variant"]) for r in rows])
    print(f"{'variant':<{width}} {'chunk':>6} {'mb tok':>6} {'seconds':>8} {'tok/s':>8} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>9}")
    ok = [r for r in rows if "error" not in r]
    base_name = "padded" if ok and ok[0]["variant"] == "padded sdpa" else ok[0]["variant"] if ok else ""
    for r in rows:
        chunk, mb_tokens = r["chunk"] or "all", r["max_tokens_per_mb"] or "-"
        if "error" in r:
            print(f"{r['variant']:<{width}} {chunk:>6} {mb_tokens:>6}   FAILED: {r['error']}")
            continue
        print(f"{r['variant']:<{width}} {chunk:>6} {mb_tokens:>6} {r['seconds']:>8.2f} {r['tok_s']:>8.0f} "
              f"{r['tflops']:>8.1f} {r['mfu']:>6.1%} {r['peak_gib']:>9.1f}   "
              f"{r['tok_s'] / ok[0]['tok_s']:.2f}x {base_name}")


def variant_step(args, policy, variant: Variant, seqs, lengths, device, tokens):
    """One iteration of ``variant`` (forward + backward of every micro-batch) as a function."""
    non_blocking = False if "blockingh2d" in variant.options else None
    if "padded" in variant.options:
        return lambda: padded_policy_step(policy, seqs, args.padded_mb, variant.chunk, device, tokens, non_blocking)
    mbs = allocate_micro_batches(lengths, variant.max_tokens_per_mb)
    return lambda: packed_step(policy, seqs, mbs, variant.chunk, device, tokens, non_blocking)


def run_variants(args, policy, variants: list[Variant], seqs, lengths, device, tokens, record, rows) -> None:
    """Time each ``Variant`` on the FSDP2 ``policy`` (``record`` appends a row); a failing variant
    appends a row with its error instead."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # variants add guard sets to the layers' code
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    switches = Switches(policy)
    if args.check:
        mb = allocate_micro_batches(lengths, args.max_tokens_per_mb)[0]
        cfg = policy.lm.config
        try:
            check_attention(device, [lengths[i] for i in mb], cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim)
        except Exception as exc:
            print(f"attention check FAILED {type(exc).__name__}: {exc}", flush=True)
    for variant in variants:
        start = time.perf_counter()
        try:
            switches.apply(variant.options)
            # compiled code: the first iteration compiles for static then dynamic shapes, some
            # backward graphs compile lazily in the second
            warmup = 2 if variant.options & {"compile", "headcompile"} else 1
            padded = "padded" in variant.options
            record(variant.name, variant.chunk, variant_step(args, policy, variant, seqs, lengths, device, tokens),
                   0 if padded else variant.max_tokens_per_mb, warmup)
            rows[-1]["micro_batches"] = (-(-len(seqs) // args.padded_mb) if padded
                                         else len(allocate_micro_batches(lengths, variant.max_tokens_per_mb)))
        except Exception as exc:  # report and go on with the next variant
            traceback.print_exc(limit=-8)  # the innermost frames
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            rows.append({"variant": variant.name, "chunk": variant.chunk,
                         "max_tokens_per_mb": variant.max_tokens_per_mb, "error": f"{type(exc).__name__}: {first_line}"})
            print(json.dumps(rows[-1]), flush=True)
            _free_memory(policy.lm)
        print(f"  ({variant.name}: {time.perf_counter() - start:.0f} s with warm-up and compilation)", flush=True)
    if args.check:
        first_mb = allocate_micro_batches(lengths, args.max_tokens_per_mb)[0]
        check_variants(policy, switches, variants, seqs, first_mb, args.chunks[0], device)
    switches.apply(variants[-1].options)  # for --profile


if __name__ == "__main__":
    main()
