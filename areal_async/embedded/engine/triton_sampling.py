"""Fused Gumbel-max sampling on CUDA (Triton): the draw and its log-prob without ``[R, V]`` temporaries.

``fused_sample`` (rows without top-k / top-p): one program per (row, ``CHUNK``-entry vocabulary
piece) finds ``max z``, ``Σ exp(z - max)`` and the best ``z + g``; one per row combines the pieces
in a fixed order into the token and ``z[token] - logsumexp(z)``. ``fused_gumbel_argmax``: the
arg-max of ``z + g``. ``g`` is ``noise_hash``'s, bitwise the torch path's uniforms (``log``:
libdevice's, where Triton has it); ties go to the lowest index; rows are independent.
"""

from __future__ import annotations

import os

import torch

from .noise_hash import FMIX1, FMIX2, WEYL32


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None

if triton is not None:
    try:  # libdevice's log, as torch's CUDA log; Triton's interpreter (CPU) has only tl.log
        from triton.language.extra import libdevice
    except ImportError:  # older Triton: its own log
        libdevice = None
    _LIBDEVICE = libdevice is not None and os.environ.get("TRITON_INTERPRET") != "1"

    @triton.jit
    def _gumbel(key, idx, WEYL: tl.constexpr, FMIX1: tl.constexpr, FMIX2: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Gumbel noise at vocab indices ``idx`` of the row keyed ``key`` (``noise_hash.noise_uniform``).
        32-bit lanes kept in int64 and masked after every multiply: exact whatever Triton's integer
        promotion rules, and every shift acts on a non-negative value."""
        k = ((key >> 32) ^ key) & 0xFFFFFFFF
        x = (k + idx.to(tl.int64) * WEYL) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * FMIX1) & 0xFFFFFFFF
        x = ((x ^ (x >> 13)) * FMIX2) & 0xFFFFFFFF
        x = x ^ (x >> 16)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if LIBDEVICE:
            g = -libdevice.log(-libdevice.log(u))
        else:
            g = -tl.log(-tl.log(u))
        return g

    @triton.jit
    def _gumbel_argmax_kernel(z_ptr, keys_ptr, out_ptr, stride, vocab: tl.constexpr, BLOCK: tl.constexpr,
                              WEYL: tl.constexpr, FMIX1: tl.constexpr, FMIX2: tl.constexpr,
                              LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)
        key = tl.load(keys_ptr + row)
        best_val = -float("inf")
        best_idx = 0
        for start in range(0, vocab, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < vocab
            z = tl.load(z_ptr + row * stride + idx, mask=valid, other=-float("inf"))
            val = tl.where(valid, z + _gumbel(key, idx, WEYL, FMIX1, FMIX2, LIBDEVICE), -float("inf"))
            block_max = tl.max(val, axis=0)
            block_idx = tl.min(tl.where(val == block_max, idx, vocab), axis=0)
            better = block_max > best_val
            best_idx = tl.where(better, block_idx, best_idx)
            best_val = tl.where(better, block_max, best_val)
        tl.store(out_ptr + row, best_idx.to(tl.int64))


CHUNK = 2048  # vocab entries per program of fused_sample


if triton is not None:

    @triton.jit
    def _sample_pieces_kernel(logits_ptr, temp_ptr, keys_ptr, part_ptr, stride, n_pieces, vocab: tl.constexpr,
                              CHUNK: tl.constexpr, WEYL: tl.constexpr, FMIX1: tl.constexpr,
                              FMIX2: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)
        piece = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        noisy = t > 0
        t = tl.where(noisy, t, 1.0)
        idx = piece * CHUNK + tl.arange(0, CHUNK)
        valid = idx < vocab
        z = tl.load(logits_ptr + row * stride + idx, mask=valid, other=-float("inf")) / t
        z_max = tl.max(z, axis=0)
        safe_max = tl.where(z_max == -float("inf"), 0.0, z_max)
        sum_exp = tl.sum(tl.exp(z - safe_max), axis=0)
        g = _gumbel(tl.load(keys_ptr + row), idx, WEYL, FMIX1, FMIX2, LIBDEVICE)
        val = tl.where(valid, z + tl.where(noisy, g, 0.0), -float("inf"))
        best = tl.max(val, axis=0)
        best_idx = tl.min(tl.where(val == best, idx, vocab), axis=0)
        out = part_ptr + (row * n_pieces + piece) * 4
        tl.store(out, z_max)
        tl.store(out + 1, sum_exp)
        tl.store(out + 2, best)
        tl.store(out + 3, best_idx.to(tl.float32))  # < 2**24: exact in fp32

    @triton.jit
    def _sample_combine_kernel(logits_ptr, temp_ptr, part_ptr, tok_ptr, logp_ptr, stride, n_pieces,
                               vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < n_pieces
        part = part_ptr + (row * n_pieces + offs) * 4
        z_max = tl.load(part, mask=valid, other=-float("inf"))
        sum_exp = tl.load(part + 1, mask=valid, other=0.0)
        best = tl.load(part + 2, mask=valid, other=-float("inf"))
        best_idx = tl.load(part + 3, mask=valid, other=vocab).to(tl.int32)
        top = tl.max(z_max, axis=0)
        scale = tl.where(z_max == -float("inf"), 0.0, tl.exp(z_max - top))
        lse = top + tl.log(tl.sum(sum_exp * scale, axis=0))
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, best_idx, vocab), axis=0)
        t = tl.load(temp_ptr + row)
        t = tl.where(t > 0, t, 1.0)
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, tl.load(logits_ptr + row * stride + token) / t - lse)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor,
                 keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token per row and its log-prob under ``log_softmax(logits / T)`` (no top-k / top-p).

    Args:
        logits: ``[R, V] float32`` CUDA, rows contiguous.
        temperature: ``[R] float32`` on the same device; ``<= 0`` ⇒ greedy (arg-max of ``logits``).
        keys: ``[R] int64`` noise keys (``noise_hash.noise_keys``); ignored for greedy rows.
    Returns:
        ``(tokens [R] int64, logprobs [R] float32)``, or ``None`` without Triton. Against
        ``sampling.sample``'s torch path the token is drawn from ``z + g`` rather than
        ``log_softmax(z) + g`` (the same arg-max up to rounding: a token can differ only at a
        near-tie) and the log-prob is rounded differently (last bits).
    """
    if triton is None:
        return None
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, \
        f"logits must be [R, V] float32 rows, got {tuple(logits.shape)} {logits.dtype}"
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        n_pieces = triton.cdiv(vocab, CHUNK)
        parts = torch.empty(rows, n_pieces, 4, dtype=torch.float32, device=logits.device)
        temperature, keys = temperature.contiguous(), keys.contiguous()
        _sample_pieces_kernel[(rows, n_pieces)](logits, temperature, keys, parts, logits.stride(0), n_pieces,
                                                vocab=vocab, CHUNK=CHUNK, WEYL=WEYL32, FMIX1=FMIX1,
                                                FMIX2=FMIX2, LIBDEVICE=_LIBDEVICE, num_warps=4)
        _sample_combine_kernel[(rows,)](logits, temperature, parts, tokens, logprobs, logits.stride(0), n_pieces,
                                        vocab=vocab, BLOCK=max(16, triton.next_power_of_2(n_pieces)), num_warps=1)
    return tokens, logprobs


def fused_gumbel_argmax(z: torch.Tensor, keys: torch.Tensor, block: int = 4096) -> torch.Tensor | None:
    """Gumbel-max draw per row of ``z``.

    Args:
        z: ``[R, V] float32`` CUDA, rows contiguous (``-inf`` entries are never drawn).
        keys: ``[R] int64`` noise keys (``noise_hash.noise_keys``), same device.
        block: vocab entries per loop iteration.
    Returns:
        ``[R] int64`` token ids, or ``None`` without Triton.
    """
    if triton is None:
        return None
    assert z.dim() == 2 and z.dtype == torch.float32 and z.stride(1) == 1, f"z must be [R, V] float32 rows, got {z.shape} {z.dtype}"
    out = torch.empty(z.shape[0], dtype=torch.int64, device=z.device)
    if z.shape[0]:
        _gumbel_argmax_kernel[(z.shape[0],)](z, keys.contiguous(), out, z.stride(0), vocab=z.shape[1], BLOCK=block,
                     WEYL=WEYL32, FMIX1=FMIX1, FMIX2=FMIX2, LIBDEVICE=_LIBDEVICE)
    return out
