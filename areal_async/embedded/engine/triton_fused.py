"""Fused element-wise kernels of a decoder layer on CUDA (Triton): 3 launches where PyTorch issues ~25.

``add_rms_norm`` (residual add + RMSNorm, Zhang & Sennrich 2019), ``qkv_rope_store`` (Qwen3's q/k
norms + RoPE, Su et al. 2021, + the K/V cache store) and ``silu_mul``: fp32 inside, one rounding per
output (HF rounds after every op: last-bit differences), row by row (batch-invariant). Without
Triton ``triton`` is ``None`` (the callers keep PyTorch); ``TRITON_INTERPRET=1`` runs them on the
CPU, as the tests do. Where each sits in a layer: docs/engine.md#how-it-works.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, eps, N: tl.constexpr,
                             BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(x_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
            tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_head(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, HALF: tl.constexpr, D: tl.constexpr,
                   HAS_NORM: tl.constexpr):
        """Load one head (two halves), per-head RMSNorm, RoPE → the two rotated halves in fp32."""
        offs = tl.arange(0, HALF)
        x1 = tl.load(x_ptr + offs).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + offs).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            x1 = x1 * rstd * tl.load(w_ptr + offs).to(tl.float32)
            x2 = x2 * rstd * tl.load(w_ptr + HALF + offs).to(tl.float32)
        c1 = tl.load(cos_ptr + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF + offs).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2  # x·cos + rotate_half(x)·sin

    @triton.jit
    def _qkv_rope_store_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, kc_ptr, vc_ptr,
                               ko_ptr, vo_ptr, stride_qkv, stride_cos, stride_q, cache_slot, cache_head, eps,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                               KV_OUT: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)  # 0..H-1: a query head; H..H+HKV-1: a KV head
        HALF: tl.constexpr = D // 2
        pos = tl.load(pos_ptr + t)
        cos_row = cos_ptr + pos * stride_cos
        sin_row = sin_ptr + pos * stride_cos
        offs = tl.arange(0, HALF)
        row = qkv_ptr + t * stride_qkv
        if head < H:
            o1, o2 = _rope_head(row + head * D, qw_ptr, cos_row, sin_row, eps, HALF, D, HAS_NORM)
            out = q_ptr + t * stride_q + head * D
            tl.store(out + offs, o1.to(q_ptr.dtype.element_ty))
            tl.store(out + HALF + offs, o2.to(q_ptr.dtype.element_ty))
        else:
            j = head - H
            k1, k2 = _rope_head(row + (H + j) * D, kw_ptr, cos_row, sin_row, eps, HALF, D, HAS_NORM)
            v = tl.load(row + (H + HKV + j) * D + tl.arange(0, D))
            place = tl.load(slot_ptr + t) * cache_slot + j * cache_head + pos * D
            tl.store(kc_ptr + place + offs, k1.to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + place + HALF + offs, k2.to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + place + tl.arange(0, D), v)
            if KV_OUT:
                kv_place = (t * HKV + j) * D
                tl.store(ko_ptr + kv_place + offs, k1.to(ko_ptr.dtype.element_ty))
                tl.store(ko_ptr + kv_place + HALF + offs, k2.to(ko_ptr.dtype.element_ty))
                tl.store(vo_ptr + kv_place + tl.arange(0, D), v)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + N + offs, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` (in place, rounded to ``x``'s dtype as ``x = x + delta`` is; not when ``delta``
    is ``None``), then ``RMSNorm(x) · weight`` in fp32, rounded once, as ``F.rms_norm`` computes it.

    Args:
        x: ``[T, N]`` the residual stream (model dtype), rows contiguous; updated in place.
        delta: ``[T, N]`` or ``None``.
        weight: ``[N]`` the norm's weight; eps: its epsilon.
    Returns:
        ``[T, N]`` in ``x``'s dtype.
    """
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, N] with contiguous rows, got {tuple(x.shape)}"
    out = torch.empty_like(x)
    if x.shape[0]:
        n = x.shape[1]
        d = delta if delta is not None else x
        assert d.shape == x.shape and d.stride(1) == 1, f"delta {tuple(d.shape)} must match x {tuple(x.shape)}"
        _add_rms_norm_kernel[(x.shape[0],)](x, d, weight, out, x.stride(0), d.stride(0), out.stride(0), eps,
                                            N=n, BLOCK=triton.next_power_of_2(n), HAS_DELTA=delta is not None,
                                            num_warps=4 if n <= 4096 else 8)
    return out


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, q_norm: tuple[torch.Tensor, float] | None,
                   k_norm: tuple[torch.Tensor, float] | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, kv_out: bool = False):
    """Split the fused projection, normalise and rotate q and k (HF's ``rotate_half`` convention),
    store k and v in the cache.

    Args:
        qkv: ``[T, (H + 2·Hkv)·D]`` the ``q|k|v`` projection output, rows contiguous.
        positions: ``[T] int64`` absolute positions (< the cache's L); slots: ``[T] int64`` cache slots.
        cos, sin: ``[L, D]`` RoPE tables (the model's ``rotary_emb`` at positions ``0..L-1``).
        q_norm, k_norm: ``(weight [D], eps)`` of the per-head norms, or ``None`` (no q/k norm).
        k_cache, v_cache: one layer's ``[S, Hkv, L, D]`` keys and values, contiguous.
        num_heads: H.
        kv_out: also return the rotated keys and the values as ``[T, Hkv, D]`` (prefill attention).
    Returns:
        ``q [T, H, D]`` (and ``k, v [T, Hkv, D]`` if ``kv_out``), in ``qkv``'s dtype.
    """
    tokens = qkv.shape[0]
    _, kv_heads, length, dim = k_cache.shape
    assert qkv.shape[1] == (num_heads + 2 * kv_heads) * dim and qkv.stride(1) == 1, \
        f"qkv {tuple(qkv.shape)} is not [T, (H + 2·Hkv)·D] with H={num_heads}, Hkv={kv_heads}, D={dim}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.shape[-1] == dim and cos.is_contiguous()
    q = torch.empty(tokens, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=qkv.dtype, device=qkv.device) if kv_out else q
    v_out = torch.empty_like(k_out) if kv_out else q
    if tokens:
        has_norm = q_norm is not None
        qw, eps = q_norm if has_norm else (cos, 0.0)
        kw = k_norm[0] if has_norm else cos
        _qkv_rope_store_kernel[(tokens, num_heads + kv_heads)](
            qkv, positions, slots, cos, sin, qw, kw, q, k_cache, v_cache, k_out, v_out,
            qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
            H=num_heads, HKV=kv_heads, D=dim, HAS_NORM=has_norm, KV_OUT=kv_out, num_warps=1)
    return (q, k_out, v_out) if kv_out else q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up: [T, 2I]`` (gate first, rows contiguous) → ``[T, I]``."""
    tokens, width = gate_up.shape
    n = width // 2
    assert gate_up.stride(1) == 1 and width == 2 * n, f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}"
    out = torch.empty(tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = 1024
        _silu_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), N=n,
                                                           BLOCK=block, num_warps=4)
    return out
