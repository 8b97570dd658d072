"""Packed causal attention for the trainer in Triton: forward and a deterministic backward.

FlashAttention-2 (Dao 2023, Algorithms 1 and 2) over one packed row: ``q [T, H, D]``,
``k, v [T, Hkv, D]``, ``cu_seqlens [B+1] int32``, causal inside each sequence, native GQA. Backward:
``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``; per key block ``dV = Pᵀ dO``, ``dK = scale · dSᵀ Q``; per
query block ``dQ = scale · dS K``. Invariant: each gradient element is summed by one program in a
fixed order (no atomics): deterministic, and independent of the packing. docs/trainer.md#packed-attention.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel: the fastest of the choices that
# tools/bench_gpu_trainer.py --check sweeps (one H200, 16k tokens of 64-2048-token sequences,
# 16 q / 8 kv heads, head_dim 128)
FWD_CONFIG = (64, 64, 4, 3)
DKDV_CONFIG = (64, 128, 8, 3)
DQ_CONFIG = (128, 64, 8, 2)

if triton is not None:

    @triton.jit
    def _seq_of_block(cu_ptr, bseq_ptr, bstart_ptr):
        """(sequence start in the row, its length, this program's first position in it); length 0
        for a surplus program, which then loads and stores nothing."""
        b = tl.load(bseq_ptr + tl.program_id(0))
        first = tl.load(bstart_ptr + tl.program_id(0))
        safe = tl.maximum(b, 0)
        start = tl.load(cu_ptr + safe).to(tl.int64)  # row offsets of long packs pass 2^31 elements
        length = tl.where(b >= 0, tl.load(cu_ptr + safe + 1) - start, 0)
        return start, length, tl.maximum(first, 0)

    @triton.jit
    def _query_block(q_ptr, k_ptr, v_ptr, cu_ptr, bseq_ptr, bstart_ptr, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
                     GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's query block (grid: block table × query heads): its sequence's start and
        length, the block's positions and their validity, the queries ``[BLOCK_M, D]``, and the
        row pointers of its K/V head at the sequence's start."""
        start, length, m0 = _seq_of_block(cu_ptr, bseq_ptr, bstart_ptr)
        h = tl.program_id(1)
        kv = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < length
        q = tl.load(q_ptr + (start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0)
        k_base = k_ptr + start * s_kt + kv * s_kh + offs_d[None, :]
        v_base = v_ptr + start * s_vt + kv * s_vh + offs_d[None, :]
        return start, length, m0, h, offs_m, offs_d, row_ok, q, k_base, v_base

    @triton.jit
    def _key_block(k_ptrs, v_ptrs, offs_n, length, MASK: tl.constexpr):
        """Keys and values ``[BLOCK_N, D]`` at ``offs_n`` and which are inside the sequence
        (``MASK``: rows past ``length`` load as zeros; else every row is known to be inside)."""
        key_ok = offs_n < length
        if MASK:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        return k, v, key_ok

    @triton.jit
    def _fwd_step(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, length, qk_scale, MASK: tl.constexpr):
        k, v, key_ok = _key_block(k_ptrs, v_ptrs, offs_n, length, MASK)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N] fp32, base-2 scaled
        if MASK:
            s = tl.where((offs_m[:, None] >= offs_n[None, :]) & key_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, bseq_ptr, bstart_ptr, qk_scale,
                    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_lh,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPAN: tl.constexpr):
        start, length, m0, h, offs_m, offs_d, row_ok, q, k_base, v_base = _query_block(
            q_ptr, k_ptr, v_ptr, cu_ptr, bseq_ptr, bstart_ptr, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, GROUP, D, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if SPAN == 0:
            # keys [0, m0): below every query of the block and inside the sequence, no mask
            for n in range(0, m0, BLOCK_N):
                offs_n = n + offs_n0
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base + offs_n[:, None] * s_kt,
                                          v_base + offs_n[:, None] * s_vt, offs_m, offs_n, length, qk_scale, False)
            hi = tl.minimum(m0 + BLOCK_M, length)
            for n in range(m0, hi, BLOCK_N):  # the diagonal: causal and length masks
                offs_n = n + offs_n0
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base + offs_n[:, None] * s_kt,
                                          v_base + offs_n[:, None] * s_vt, offs_m, offs_n, length, qk_scale, True)
        else:
            for n in range(0, SPAN, BLOCK_N):
                offs_n = n + offs_n0
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base + offs_n[:, None] * s_kt,
                                          v_base + offs_n[:, None] * s_vt, offs_m, offs_n, length, qk_scale, True)
        out = acc / l_i[:, None]
        tl.store(o_ptr + (start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + h * s_lh + start + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)

    @triton.jit
    def _dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, offs_m, offs_n, length, qk_scale,
                   MASK: tl.constexpr):
        row_ok = offs_m < length
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))  # rows past the end: P = 0
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # [N, M]
        if MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))  # [N, M] fp32
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr, bseq_ptr,
                     bstart_ptr, qk_scale, scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_lh,
                     s_dkt, s_dkh, s_dvt, s_dvh,
                     GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPAN: tl.constexpr):
        start, length, n0 = _seq_of_block(cu_ptr, bseq_ptr, bstart_ptr)
        kv = tl.program_id(1)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        offs_m0 = tl.arange(0, BLOCK_M)
        key_ok = offs_n < length
        k = tl.load(k_ptr + (start + offs_n)[:, None] * s_kt + kv * s_kh + offs_d[None, :], mask=key_ok[:, None],
                    other=0.0)
        v = tl.load(v_ptr + (start + offs_n)[:, None] * s_vt + kv * s_vh + offs_d[None, :], mask=key_ok[:, None],
                    other=0.0)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        for g in tl.static_range(GROUP):
            h = kv * GROUP + g
            q_base = q_ptr + start * s_qt + h * s_qh + offs_d[None, :]
            do_base = do_ptr + start * s_dot + h * s_doh + offs_d[None, :]
            lse_base = lse_ptr + h * s_lh + start
            delta_base = delta_ptr + h * s_lh + start
            if SPAN == 0:
                diag_end = tl.minimum(n0 + BLOCK_N, length)
                for m in range(n0, diag_end, BLOCK_M):  # queries on the diagonal: causal mask
                    offs_m = m + offs_m0
                    dk, dv = _dkdv_step(dk, dv, k, v, q_base + offs_m[:, None] * s_qt, do_base + offs_m[:, None] * s_dot,
                                        lse_base + offs_m, delta_base + offs_m, offs_m, offs_n, length, qk_scale, True)
                for m in range(n0 + BLOCK_N, length, BLOCK_M):  # queries after every key of the block
                    offs_m = m + offs_m0
                    dk, dv = _dkdv_step(dk, dv, k, v, q_base + offs_m[:, None] * s_qt, do_base + offs_m[:, None] * s_dot,
                                        lse_base + offs_m, delta_base + offs_m, offs_m, offs_n, length, qk_scale, False)
            else:
                for m in range(0, SPAN, BLOCK_M):
                    offs_m = m + offs_m0
                    dk, dv = _dkdv_step(dk, dv, k, v, q_base + offs_m[:, None] * s_qt, do_base + offs_m[:, None] * s_dot,
                                        lse_base + offs_m, delta_base + offs_m, offs_m, offs_n, length, qk_scale, True)
        tl.store(dk_ptr + (start + offs_n)[:, None] * s_dkt + kv * s_dkh + offs_d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
        tl.store(dv_ptr + (start + offs_n)[:, None] * s_dvt + kv * s_dvh + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])

    @triton.jit
    def _dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, length, qk_scale, MASK: tl.constexpr):
        k, v, key_ok = _key_block(k_ptrs, v_ptrs, offs_n, length, MASK)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])  # [M, N]
        if MASK:
            p = tl.where((offs_m[:, None] >= offs_n[None, :]) & key_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        return dq

    @triton.jit
    def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr, bseq_ptr, bstart_ptr,
                   qk_scale, scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_lh, s_dqt, s_dqh,
                   GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPAN: tl.constexpr):
        start, length, m0, h, offs_m, offs_d, row_ok, q, k_base, v_base = _query_block(
            q_ptr, k_ptr, v_ptr, cu_ptr, bseq_ptr, bstart_ptr, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, GROUP, D, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        do = tl.load(do_ptr + (start + offs_m)[:, None] * s_dot + h * s_doh + offs_d[None, :], mask=row_ok[:, None],
                     other=0.0)
        lse = tl.load(lse_ptr + h * s_lh + start + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + h * s_lh + start + offs_m, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        if SPAN == 0:
            for n in range(0, m0, BLOCK_N):
                offs_n = n + offs_n0
                dq = _dq_step(dq, q, do, lse, delta, k_base + offs_n[:, None] * s_kt, v_base + offs_n[:, None] * s_vt,
                              offs_m, offs_n, length, qk_scale, False)
            hi = tl.minimum(m0 + BLOCK_M, length)
            for n in range(m0, hi, BLOCK_N):
                offs_n = n + offs_n0
                dq = _dq_step(dq, q, do, lse, delta, k_base + offs_n[:, None] * s_kt, v_base + offs_n[:, None] * s_vt,
                              offs_m, offs_n, length, qk_scale, True)
        else:
            for n in range(0, SPAN, BLOCK_N):
                offs_n = n + offs_n0
                dq = _dq_step(dq, q, do, lse, delta, k_base + offs_n[:, None] * s_kt, v_base + offs_n[:, None] * s_vt,
                              offs_m, offs_n, length, qk_scale, True)
        tl.store(dq_ptr + (start + offs_m)[:, None] * s_dqt + h * s_dqh + offs_d[None, :],
                 (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def block_table(cu_seqlens: Tensor, num_tokens: int, block: int, longest_first_from_end: bool) -> tuple[Tensor, Tensor]:
    """The programs' work list: ``(seq [P] int32, first [P] int32)``, the sequence and the first
    position of block ``p`` of ``block`` positions, for ``P = num_tokens // block + B`` programs (an
    upper bound on ``Σ_b ceil(L_b / block)``); surplus entries have ``seq = first = -1`` and come
    last. Order: ``first`` descending (``longest_first_from_end``: query blocks, whose work grows
    with the position) or ascending (key blocks, whose work shrinks with it). Built on the device
    from ``cu_seqlens [B+1] int32`` with no host synchronisation."""
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    num_seqs = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    blocks = (lengths + block - 1) // block
    ends = torch.cumsum(blocks, 0)
    programs = num_tokens // block + num_seqs
    idx = torch.arange(programs, device=device)
    seq = torch.searchsorted(ends, idx, right=True)
    valid = seq < num_seqs
    safe = seq.clamp(max=num_seqs - 1)
    first = (idx - (ends[safe] - blocks[safe])) * block
    key = torch.where(valid, first if longest_first_from_end else -first, torch.full_like(first, -(1 << 40)))
    order = torch.argsort(key, descending=True, stable=True)
    seq = torch.where(valid, seq, -1)[order].to(torch.int32)
    first = torch.where(valid, first, -1)[order].to(torch.int32)
    return seq, first


def _span(max_seqlen: int, *blocks: int) -> int:
    """The interpreter's fixed loop bound: ``max_seqlen`` rounded up to every block size."""
    step = math.lcm(*blocks)
    return -(-max_seqlen // step) * step if _INTERPRET else 0


def _check(q: Tensor, k: Tensor, v: Tensor, cu: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention takes q [T, H, D] and k, v [T, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of K/V heads ({k.shape[1]})")
    if q.shape[2] not in (16, 32, 64, 128):
        raise ValueError(f"head_dim {q.shape[2]} is not supported by the Triton attention (its tiles are sized "
                         f"for 16, 32, 64 or 128); use trainer.attention_backend=flash")
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise ValueError(f"cu_seqlens must be [B+1] int32, got {tuple(cu.shape)} {cu.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride {t.stride(2)})")


@torch.library.custom_op("areal_async::varlen_attention_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> tuple[Tensor, Tensor]:
    tokens, heads, dim = q.shape
    block_m, block_n, num_warps, num_stages = FWD_CONFIG
    assert block_m % block_n == 0, f"forward BLOCK_M {block_m} must be a multiple of BLOCK_N {block_n}"
    out = torch.empty_like(q)
    lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
    seq, first = block_table(cu_seqlens, tokens, block_m, True)
    _fwd_kernel[(seq.numel(), heads)](
        q, k, v, out, lse, cu_seqlens, seq, first, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), GROUP=heads // k.shape[1], D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        SPAN=_span(max_seqlen, block_m, block_n), num_warps=num_warps, num_stages=num_stages)
    return out, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("areal_async::varlen_attention_bwd", mutates_args=())
def _bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
            max_seqlen: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    grad_out = grad_out.contiguous()
    delta = (out.float() * grad_out.float()).sum(-1).t().contiguous()  # [H, T]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    group = heads // kv_heads
    block_m, block_n, num_warps, num_stages = DKDV_CONFIG
    assert block_n % block_m == 0, f"dK/dV BLOCK_N {block_n} must be a multiple of BLOCK_M {block_m}"
    seq, first = block_table(cu_seqlens, tokens, block_n, False)
    _dkdv_kernel[(seq.numel(), kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens, seq, first, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0),
        grad_out.stride(1), lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        GROUP=group, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, SPAN=_span(max_seqlen, block_m, block_n),
        num_warps=num_warps, num_stages=num_stages)
    block_m, block_n, num_warps, num_stages = DQ_CONFIG
    assert block_m % block_n == 0, f"dQ BLOCK_M {block_m} must be a multiple of BLOCK_N {block_n}"
    seq, first = block_table(cu_seqlens, tokens, block_m, True)
    _dq_kernel[(seq.numel(), heads)](
        q, k, v, grad_out, lse, delta, dq, cu_seqlens, seq, first, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0),
        grad_out.stride(1), lse.stride(0), dq.stride(0), dq.stride(1),
        GROUP=group, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, SPAN=_span(max_seqlen, block_m, block_n),
        num_warps=num_warps, num_stages=num_stages)
    return dq, dk, dv


@_bwd_op.register_fake
def _bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _bwd_op(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     scale: float | None = None) -> Tensor:
    """Causal attention inside each packed sequence, differentiable (see the module docstring).

    Args:
        q: ``[T, H, D]`` bf16/fp16 (fp32 works too, with TF32 products), last dim contiguous.
        k, v: ``[T, Hkv, D]``, ``H % Hkv == 0``; same dtype and device as ``q``.
        cu_seqlens: ``[B+1] int32`` cumulative sequence lengths, ``cu_seqlens[B] == T``.
        max_seqlen: the longest sequence (int; used only as the interpreter's loop bound).
        scale: softmax scale, ``None`` = ``1/sqrt(D)``.

    Returns:
        ``[T, H, D]`` in ``q``'s dtype.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: shapes, head_dim or ``cu_seqlens``' dtype the kernels do not take.
    """
    if triton is None:
        raise RuntimeError("trainer.attention_backend=triton needs Triton (pip install triton); or use "
                           "trainer.attention_backend=flash")
    _check(q, k, v, cu_seqlens)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _fwd_op(q, k, v, cu_seqlens, int(max_seqlen), scale)[0]
