"""Tree attention alone (no model), forward + backward: the shared-prefix paths against no sharing.

    python tools/bench_tree_attention.py                         # CUDA bf16, SmolLM2-135M heads 9/3/64
    python tools/bench_tree_attention.py --heads 16,8,128        # Qwen3-0.6B heads
    python tools/bench_tree_attention.py --device cpu --groups 2 --samples 3 --prompt-len 20,40 \
        --response-len 5,30 --max-tokens 4096 --iters 1 --warmup 0   # the logic, on CPU

Batch: the GPU GRPO shape of ``tools/bench_trainer.py --shape gpu`` (``--groups`` 32 × ``--samples``
8, prompts of 512–1024 random tokens, responses of 256–1024, lengths and tokens from ``--seed``).
The sequences are cut and allocated the way the trainer cuts them with ``trainer.share_prefixes``
(``tree.cut_units`` under ``--max-tokens``, then ``packing.allocate_micro_batches``; every
sequence, none skipped for a zero advantage), and the
**first micro-batch** of that plan is measured (one micro-batch, not the whole batch). Its
sequences' unshared packing (variant a) is the same sequences back to back, so it holds more
tokens than the budget: it is what the trainer would forward for them without sharing.

Inputs: random Q ``[N, H, D]`` and K/V ``[N, H_kv, D]`` per tree node (``N`` unique tokens), so a
shared prompt token has the same Q/K/V in every sequence that holds it; the unshared layout
gathers them per sequence position (``T`` = Σ lengths). The upstream gradient is random per
sequence position; a node's is the sum over the positions it stands for, so every variant
computes the gradient of one and the same scalar.

Variants (each forward + backward of the attention alone; timed with CUDA events after
``--warmup`` runs, median of ``--iters``):

- ``a``: no sharing, every sequence's prompt + response through ``varlen_attn`` causal (the
  trainer's unshared packing). On CPU: causal ``sdpa`` per sequence (the trainer's CPU path).
- ``b``: FlexAttention under the forest's block mask, as the trainer runs it
  (``attention.tree_block_mask``, ``attention._flex_tree``: compiled, ``dynamic=True``). The first
  call (compilation) and the block-mask build are reported apart from the steady state. CUDA only.
- ``c``: ``sdpa`` per tree with the boolean ancestor mask (``attention._sdpa_per_tree``: the CPU
  and deterministic path), here on the measured device.
- ``d``: ``varlen_attn`` with separate query/key ``cu_seqlens`` over gathered ancestor K/V. The
  forest is cut into chains (a new chain at each root and at each child of a node with several
  children: a group's prompt, each sample's response); a chain's query run is its own nodes, its
  key run the K/V of its ancestors (gathered: ``index_select``) followed by its own, causal
  aligned to the bottom right (query ``i`` of a run of ``q`` reads the first ``k - q + i + 1`` keys).
  The prompt's own queries are the root chain's run. The backward sums the dK/dV of the gathered
  copies back into the ancestor nodes (the ``index_select`` backward, an ``index_add``). This is
  the trainer's ``trainer.tree_attention=varlen`` path itself (``tree.chain_layout``,
  ``attention.varlen_tree_attention``). On CPU the kernel is emulated by ``sdpa`` per run with
  the bottom-right causal mask (``attention.bottom_right_varlen_reference``; the index logic is
  what is checked there).
- ``ref`` (CPU only): one ``sdpa`` over all ``N`` nodes with the dense ``[N, N]`` ancestor mask,
  in float64.

Each variant's outputs (per sequence position) and dQ/dK/dV (per node; those of ``a`` summed over
the positions of each node) are compared with the baseline: ``a`` on CUDA, ``ref`` on CPU. The
table: variant, tokens of Q, tokens of K/V read (K/V rows the kernel takes as input: ``T`` for
``a``, ``N`` for ``b``/``c``, Σ key-run lengths for ``d``), ms forward, ms backward, ms total,
ratio of ``a``'s total to the variant's, max |Δ| out, max |Δ| grads, peak memory of the variant.
Exit status 1 if a variant's max |Δ| exceeds ``atol + rtol · max |baseline|`` (bf16: 2e-2 +
2e-2·max; fp32: 1e-5 + 1e-5·max; float64 reference on CPU) or a variant fails to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from areal_async.dtypes import FLOAT_DTYPES
from areal_async.trainer import attention
from areal_async.trainer.packing import allocate_micro_batches
from areal_async.trainer.tree import ChainLayout, _sorted_with_lcp, cut_units, pack_tree

VOCAB = 49152  # SmolLM2's; only the chance of equal random tokens depends on it


def make_sequences(groups: int, samples: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                   seed: int) -> list[list[int]]:
    """``groups × samples`` token lists ``prompt + response``, the samples of a group sharing their
    prompt; lengths uniform in the inclusive ranges, tokens uniform in ``[0, VOCAB)``."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
        for _ in range(samples):
            seqs.append(prompt + rng.integers(0, VOCAB, int(rng.integers(response_len[0], response_len[1] + 1))).tolist())
    return seqs


def first_micro_batch(seqs: list[list[int]], max_tokens: int) -> tuple[list[int], int]:
    """Indices of the sequences in the first micro-batch of the trainer's shared-prefix plan
    (``cut_units`` + ``allocate_micro_batches``, as ``plan.assign_micro_batches`` does), and the plan's count."""
    units = cut_units(seqs, max_tokens)
    mbs = allocate_micro_batches([cost for _, cost in units], max_tokens)
    return sorted(i for u in mbs[0] for i in units[u][0]), len(mbs)


def node_paths(seqs: list[list[int]]) -> list[np.ndarray]:
    """Per sequence, the forest node of each of its positions (``pack_tree``'s node numbering:
    sorted order, a sequence's first ``lcp`` nodes those of the previous one)."""
    order, lcp = _sorted_with_lcp(seqs)
    paths: list[np.ndarray | None] = [None] * len(seqs)
    path, n = np.zeros(0, dtype=np.int64), 0
    for r, i in enumerate(order):
        new = len(seqs[i]) - lcp[r]
        path = np.concatenate([path[: lcp[r]], np.arange(n, n + new, dtype=np.int64)])
        paths[i] = path
        n += new
    return paths


@dataclasses.dataclass
class Layout:
    """A micro-batch in the layouts the variants need (``N`` nodes, ``T`` sequence positions)."""

    node_of: Tensor  # [T] int64: node of each position of the unshared layout
    cu_seqs: Tensor  # [B+1] int32: the unshared layout's sequence boundaries
    max_seq: int
    subtree_end: Tensor  # [N] int64
    cu_trees: Tensor  # [K+1] int32
    cu_q: Tensor  # [S+1] int32: chain query runs (d)
    cu_k: Tensor  # [S+1] int32: chain key runs (d)
    max_q: int
    max_k: int
    key_index: Tensor  # [Σ key runs] int64: node of each gathered key row (d)

    @property
    def num_nodes(self) -> int:
        return int(self.subtree_end.numel())


def build_layout(seqs: list[list[int]]) -> Layout:
    """The forest of ``seqs`` (``pack_tree``), the node of every position, and its chains (see
    the module docstring, variant ``d``).

    Raises:
        RuntimeError: the node numbering disagrees with ``pack_tree``'s tokens or depths.
    """
    tree = pack_tree(seqs, attention="varlen")
    paths = node_paths(seqs)
    node_of = np.concatenate(paths)
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    depth = np.concatenate([np.arange(len(s)) for s in seqs])
    if not (np.array_equal(tree.input_ids.numpy()[node_of], flat)
            and np.array_equal(tree.position_ids.numpy()[node_of], depth)):
        raise RuntimeError("node numbering disagrees with pack_tree (tokens or depths); tree.py changed its layout")
    chains = tree.chains  # the trainer's chain layout (tree.chain_layout), shared with variant d
    lengths = np.asarray([len(s) for s in seqs])
    cum = lambda x: torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)  # noqa: E731
    return Layout(node_of=torch.from_numpy(node_of), cu_seqs=cum(lengths), max_seq=int(lengths.max()),
                  subtree_end=tree.subtree_end, cu_trees=tree.cu_trees, cu_q=chains.cu_q, cu_k=chains.cu_k,
                  max_q=chains.max_q, max_k=chains.max_k, key_index=chains.key_index)


def _dense_tree(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor) -> Tensor:
    """``[N, H, D]`` → ``[N, H, D]``: one ``sdpa`` with the dense ``[N, N]`` mask ``j ≤ i < subtree_end[j]``."""
    n_rep = q.shape[1] // k.shape[1]
    idx = torch.arange(q.shape[0], device=q.device)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(n_rep, 1).transpose(0, 1),
                                         v.repeat_interleave(n_rep, 1).transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


@dataclasses.dataclass
class Variant:
    name: str
    q_tokens: int
    kv_tokens: int
    per_node: bool  # inputs are the node tensors (else the unshared layout's)
    fn: object  # (q, k, v) → out, in its own layout


def variants(lay: Layout, device: torch.device, which: list[str]) -> list[Variant]:
    """The variants to run on ``device`` (see the module docstring)."""
    cuda, n, t = device.type == "cuda", lay.num_nodes, int(lay.node_of.numel())
    cu_seqs, cu_trees, sub = lay.cu_seqs.to(device), lay.cu_trees.to(device), lay.subtree_end.to(device)
    cu_q, cu_k, key_index = lay.cu_q.to(device), lay.cu_k.to(device), lay.key_index.to(device)
    out: list[Variant] = []

    def flat_a(q, k, v):
        if cuda:
            from torch.nn.attention.varlen import varlen_attn

            return varlen_attn(q, k, v, cu_seqs, cu_seqs, lay.max_seq, lay.max_seq, **attention._CAUSAL,
                               **attention._GQA_FLAG)
        n_rep = q.shape[1] // k.shape[1]
        rep = lambda x: attention._repeat_kv(x.transpose(0, 1)[None], n_rep, 1)  # noqa: E731
        return attention._sdpa_per_sequence(q.transpose(0, 1)[None], rep(k), rep(v), cu_seqs, None)[0]

    def flex_b(q, k, v, block_mask=None):
        n_rep = q.shape[1] // k.shape[1]
        mask = block_mask if block_mask is not None else attention.tree_block_mask(sub)
        return attention._flex_tree(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                    mask, None, n_rep)[0]

    def sdpa_c(q, k, v):
        n_rep = q.shape[1] // k.shape[1]
        rep = lambda x: attention._repeat_kv(x.transpose(0, 1)[None], n_rep, 1)  # noqa: E731
        return attention._sdpa_per_tree(q.transpose(0, 1)[None], rep(k), rep(v), cu_trees, sub, None)[0]

    chains = ChainLayout(cu_q, cu_k, lay.max_q, lay.max_k, key_index)

    def varlen_d(q, k, v):  # the trainer's tree path (CPU: its sdpa stand-in for the kernel)
        return attention.varlen_tree_attention(q, k, v, chains)

    def dense_ref(q, k, v):
        return _dense_tree(q, k, v, sub)

    table = {"a": (t, t, False, flat_a), "b": (n, n, True, flex_b), "c": (n, n, True, sdpa_c),
             "d": (n, int(key_index.numel()), True, varlen_d), "ref": (n, n, True, dense_ref)}
    for name in which:
        if name == "b" and not cuda:
            continue  # the trainer never takes FlexAttention on CPU (docs/trainer.md)
        if name == "ref" and cuda:
            continue
        q_tok, kv_tok, per_node, fn = table[name]
        out.append(Variant(name, q_tok, kv_tok, per_node, fn))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(var: Variant, qn: Tensor, kn: Tensor, vn: Tensor, d_out: Tensor, lay: Layout, device: torch.device,
                warmup: int, iters: int) -> dict:
    """Time ``var`` (forward, backward; ms, medians over ``iters`` after ``warmup``) and return its
    last outputs per sequence position ``[T, H, D]`` and gradients per node, in float64 on CPU."""
    node_of = lay.node_of.to(device)
    if var.per_node:
        leaves = [x.detach().clone().requires_grad_() for x in (qn, kn, vn)]
        grad_out = torch.zeros_like(qn).index_add_(0, node_of, d_out)
    else:
        leaves = [x.detach()[node_of].clone().requires_grad_() for x in (qn, kn, vn)]
        grad_out = d_out
    fwd, bwd = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_first = None
    for it in range(warmup + iters):
        for x in leaves:
            x.grad = None
        if device.type == "cuda":
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            w0 = time.perf_counter()
            e0.record()
            out = var.fn(*leaves)
            e1.record()
            out.backward(grad_out)
            e2.record()
            torch.cuda.synchronize()
            f_ms, b_ms = e0.elapsed_time(e1), e1.elapsed_time(e2)
            if it == 0:
                t_first = (time.perf_counter() - w0) * 1e3
        else:
            w0 = time.perf_counter()
            out = var.fn(*leaves)
            w1 = time.perf_counter()
            out.backward(grad_out)
            w2 = time.perf_counter()
            f_ms, b_ms = (w1 - w0) * 1e3, (w2 - w1) * 1e3
            if it == 0:
                t_first = (w2 - w0) * 1e3
        if it >= warmup:
            fwd.append(f_ms)
            bwd.append(b_ms)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    out = out.detach()
    grads = [x.grad.detach() for x in leaves]
    if not var.per_node:
        out_pos = out
        grads = [g.new_zeros(lay.num_nodes, *g.shape[1:], dtype=torch.float32).index_add_(0, node_of, g.float())
                 for g in grads]  # summed over each node's positions in fp32, not in the input dtype
    else:
        out_pos = out[node_of]
    fm, bm = statistics.median(fwd), statistics.median(bwd)
    return {"fwd": fm, "bwd": bm, "total": fm + bm, "first": t_first, "peak": peak,
            "out": out_pos.double().cpu(), "grads": [g.double().cpu() for g in grads]}


def compare(res: dict, base: dict, rtol: float, atol: float) -> tuple[float, float, bool]:
    """``(max |Δ out|, max |Δ grad| over dQ/dK/dV, within tolerance)`` against ``base``."""
    d_out = float((res["out"] - base["out"]).abs().max())
    ok = d_out <= atol + rtol * float(base["out"].abs().max())
    d_grad = 0.0
    for g, gb in zip(res["grads"], base["grads"]):
        d = float((g - gb).abs().max())
        d_grad = max(d_grad, d)
        ok = ok and d <= atol + rtol * float(gb.abs().max())
    return d_out, d_grad, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=sorted(FLOAT_DTYPES),
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--heads", default="9,3,64", help="query heads, K/V heads, head dim (Qwen3-0.6B: 16,8,128)")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", default="512,1024", help="min,max prompt tokens (inclusive)")
    ap.add_argument("--response-len", default="256,1024", help="min,max response tokens (inclusive)")
    ap.add_argument("--max-tokens", type=int, default=32768, help="micro-batch budget (trainer.max_tokens_per_mb)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="a,b,c,d,ref", help="subset of a,b,c,d,ref (ref and b: one device each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch.cuda.is_available() is False; use --device cpu for the CPU check")
    dtype = FLOAT_DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    try:
        h, h_kv, dim = (int(x) for x in args.heads.split(","))
        p_len = tuple(int(x) for x in args.prompt_len.split(","))
        r_len = tuple(int(x) for x in args.response_len.split(","))
    except ValueError as e:
        raise ValueError(f"--heads H,H_kv,D and --prompt-len/--response-len MIN,MAX take integers ({e})") from None
    if h % h_kv:
        raise ValueError(f"--heads {args.heads}: query heads {h} must be a multiple of K/V heads {h_kv}")
    if len(p_len) != 2 or len(r_len) != 2 or not (1 <= p_len[0] <= p_len[1]) or not (1 <= r_len[0] <= r_len[1]):
        raise ValueError(f"--prompt-len {args.prompt_len} / --response-len {args.response_len}: "
                         "give MIN,MAX with 1 <= MIN <= MAX")
    which = args.variants.split(",")
    if "a" not in which or not set(which) <= {"a", "b", "c", "d", "ref"}:
        raise ValueError(f"--variants {args.variants}: a subset of a,b,c,d,ref that includes a (the ratios' base)")

    seqs = make_sequences(args.groups, args.samples, p_len, r_len, args.seed)
    t0 = time.perf_counter()
    idx, n_mb = first_micro_batch(seqs, args.max_tokens)
    mb = [seqs[i] for i in idx]
    lay = build_layout(mb)
    plan_s = time.perf_counter() - t0
    n, t = lay.num_nodes, int(lay.node_of.numel())
    print(f"batch: {args.groups} groups x {args.samples} samples, prompts {p_len[0]}-{p_len[1]}, responses "
          f"{r_len[0]}-{r_len[1]}, seed {args.seed}; micro-batch 1 of {n_mb} under {args.max_tokens} tokens: "
          f"{len(mb)} sequences, {t} tokens unshared, {n} nodes ({t / n:.2f}x), {lay.cu_trees.numel() - 1} trees, "
          f"{lay.cu_q.numel() - 1} chains; plan + layout {plan_s:.2f} s", flush=True)
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"heads {h}/{h_kv}/{dim}, {dtype}, {device}{name}",
          flush=True)

    g = torch.Generator(device="cpu").manual_seed(args.seed)
    qn = torch.randn(n, h, dim, generator=g).to(device, dtype)
    kn = torch.randn(n, h_kv, dim, generator=g).to(device, dtype)
    vn = torch.randn(n, h_kv, dim, generator=g).to(device, dtype)
    d_out = torch.randn(t, h, dim, generator=g).to(device, dtype)
    vars_ = variants(lay, device, which)
    if device.type == "cpu" and "ref" in which:  # the reference in float64
        vars_ = [v for v in vars_ if v.name != "ref"] + [v for v in vars_ if v.name == "ref"]

    results, failed, extra = {}, [], []
    for var in vars_:
        try:
            if var.name == "b":  # block mask: first build (compiles create_block_mask) and steady builds
                sub = lay.subtree_end.to(device)
                w0 = time.perf_counter()
                mask = attention.tree_block_mask(sub)
                _sync(device)
                first_build = (time.perf_counter() - w0) * 1e3
                builds = []
                for _ in range(max(args.iters, 1)):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    mask = attention.tree_block_mask(sub)
                    e1.record()
                    torch.cuda.synchronize()
                    builds.append(e0.elapsed_time(e1))
                extra.append(f"b: block mask build first {first_build:.0f} ms (compiles), steady "
                             f"{statistics.median(builds):.2f} ms; in the table b's times exclude it")
                fn = var.fn
                var = dataclasses.replace(var, fn=lambda q, k, v, m=mask, f=fn: f(q, k, v, m))
            if var.name == "ref":
                res = run_variant(var, qn.double(), kn.double(), vn.double(), d_out.double(), lay, device, 0, 1)
            else:
                res = run_variant(var, qn, kn, vn, d_out, lay, device, args.warmup, args.iters)
            results[var.name] = res
            if var.name == "b":
                extra.append(f"b: first forward + backward {res['first']:.0f} ms (compiles flex_attention, "
                             f"dynamic=True), steady {res['total']:.2f} ms")
        except Exception:  # noqa: BLE001 - report every variant, fail at the end
            failed.append(var.name)
            print(f"variant {var.name} FAILED:\n{traceback.format_exc()}", flush=True)

    base_name = "a" if device.type == "cuda" else "ref"
    if dtype == torch.float32:
        rtol = atol = 1e-5
    else:
        rtol = atol = 2e-2
    base = results.get(base_name)
    a_total = results["a"]["total"] if "a" in results else float("nan")
    header = (f"{'variant':8s} {'Q tok':>8s} {'K/V tok':>9s} {'fwd ms':>9s} {'bwd ms':>9s} {'total ms':>9s} "
              f"{'a/x':>6s} {'max|dOut|':>10s} {'max|dGrad|':>10s} {'peak GiB':>8s}  check")
    lines = [header, "-" * len(header)]
    for var in vars_:
        res = results.get(var.name)
        if res is None:
            lines.append(f"{var.name:8s} {var.q_tokens:8d} {var.kv_tokens:9d}  FAILED (see above)")
            continue
        if base is None:
            d_out, d_grad, ok = float("nan"), float("nan"), False
        elif var.name == base_name:
            d_out, d_grad, ok = 0.0, 0.0, True
        else:
            d_out, d_grad, ok = compare(res, base, rtol, atol)
        if not ok:
            failed.append(var.name)
        ratio = a_total / res["total"] if res["total"] > 0 else float("nan")
        lines.append(f"{var.name:8s} {var.q_tokens:8d} {var.kv_tokens:9d} {res['fwd']:9.2f} {res['bwd']:9.2f} "
                     f"{res['total']:9.2f} {ratio:6.2f} {d_out:10.3g} {d_grad:10.3g} {res['peak']:8.2f}  "
                     f"{'ok' if ok else 'OVER TOLERANCE' if base is not None else 'no baseline'}")
    print("\n".join(lines))
    for line in extra:
        print(line)
    print(f"Δ against {base_name} ({'varlen_attn unshared' if base_name == 'a' else 'dense-mask sdpa, float64'}); "
          f"tolerance {atol:g} + {rtol:g}·max|{base_name}|; a/x = a's total ms over the variant's; "
          f"times: median of {args.iters} after {args.warmup} warm-up"
          + (", CUDA events" if device.type == "cuda" else ", wall clock (CPU: not a measurement)"))
    if device.type == "cuda":
        peaks = [r["peak"] for r in results.values()]
        print(f"peak GPU memory allocated: {max(peaks, default=float('nan')):.2f} GiB (the largest variant's; "
              f"'peak GiB' per variant includes the inputs of all variants)")
    if failed:
        print(f"FAILED: {', '.join(sorted(set(failed)))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
