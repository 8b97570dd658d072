"""Grouped-query decode attention over the slot KV cache, one Triton program per (row, KV head).

Each program loads its KV head's ``H / Hkv`` query heads once (padded to 16 rows for tensor cores)
and streams that head's ``[S, Hkv, L, D]`` keys and values up to the row's own position, read on
the device (so one kernel and one CUDA graph serve every span), with an online softmax (Milakov &
Gimelshein 2018; FlashAttention, Dao et al. 2022) in fp32, ``P`` rounded to the cache dtype for
``P·V``. A row's result depends only on its own query, cache and position (batch-invariant).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale,
                                 sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h,
                                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                 IEEE: tl.constexpr, SPAN: tl.constexpr):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        offs_g = tl.arange(0, GP)  # the G query heads of this KV head, zero-padded to GP ≥ 16 rows for tl.dot
        offs_d = tl.arange(0, D)
        real = offs_g < G
        heads = kv_head * G + offs_g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=real[:, None], other=0.0)
        m = tl.full([GP], -float("inf"), tl.float32)
        denom = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        k_base = k_ptr + b * sk_b + kv_head * sk_h
        v_base = v_ptr + b * sv_b + kv_head * sv_h
        # Positions past the row's own load nothing (masked) and leave m, denom and acc exactly as
        # they were (p = 0, alpha = 1): only the blocks that hold positions 0..pos are visited.
        # (SPAN > 0: a fixed bound instead, for Triton's CPU interpreter, which cannot loop to a
        # loaded value; the extra blocks change nothing.)
        for start in range(0, pos + 1 if SPAN == 0 else SPAN, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n <= pos
            k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :], mask=valid[:, None], other=0.0)  # [N, D]
            if IEEE:  # fp32 caches: full-precision products, not TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, N] fp32
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :], mask=valid[:, None], other=0.0)  # [N, D]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / denom[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=real[:, None])


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (BLOCK_N, num_warps, num_stages) of the kernel; tools/bench_gpu_engine.py --attention-configs sweeps others
CONFIG = (64, 4, 2)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float, config: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """Attention of one new token per row over its cached positions ``0..positions[b]``.

    Args:
        q: ``[B, H, D]`` queries (after RoPE), CUDA, last dim contiguous.
        keys: ``[≥B, Hkv, L, D]`` keys of slots ``0..B-1`` (``KVCache.k[layer]``, untransposed).
        values: ``[≥B, Hkv, L, D]`` values (``KVCache.v[layer]``).
        positions: ``[B] int64``; row b attends to positions ``0..positions[b]`` of slot b
            (``positions[b] < L``).
        scale: softmax scale.
        config: ``(BLOCK_N, num_warps, num_stages)``; ``None``: ``CONFIG``.
    Returns:
        ``[B, H, D]`` in ``q``'s dtype, or ``None`` without Triton.
    """
    if triton is None:
        return None
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    assert q.stride(2) == 1 and keys.stride(3) == 1 and values.stride(3) == 1, "last dims must be contiguous"
    block_n, num_warps, num_stages = config or CONFIG
    out = torch.empty_like(q)
    _decode_attention_kernel[(batch, kv_heads)](
        q, keys, values, positions, out, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, SPAN=keys.shape[2] if _INTERPRET else 0, num_warps=num_warps,
        num_stages=num_stages)
    return out
