"""Packed (variable-length) causal attention for HF models, registered as ``"packed"``.

``use_packed_attention(model)`` registers the function below with transformers'
``AttentionInterface`` and switches the model to it. The model is then called on one packed row
(batch size 1) with the boundaries as keyword arguments, which transformers forwards to every
attention layer::

    model(input_ids=ids[None], position_ids=pos[None], **packed_kwargs(batch))

Attention never crosses a sequence boundary:

- CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (flash varlen kernel) with
  ``window_size=(-1, 0)`` (causal).
- Otherwise (CPU, or fp32 anywhere): ``scaled_dot_product_attention`` with ``is_causal=True``
  applied to each sequence's slice in turn. This is the block-diagonal causal mask built from
  ``cu_seqlens``, evaluated block by block: the result is the same as with the full ``[T, T]``
  mask, but it costs Σ L_b² instead of T², which on a CPU is the difference between a cheap and
  an unusable training step for a 4k-token micro-batch.

Grouped-query attention is handled by repeating K/V heads up to the query head count. Because
transformers only builds masks for the attention names it knows, no ``[T, T]`` mask is ever
created for ``"packed"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface

NAME = "packed"


def packed_kwargs(cu_seqlens: Tensor, max_seqlen: int) -> dict:
    """Keyword arguments that carry the sequence boundaries through ``model(...)``.

    Args:
        cu_seqlens: ``[B+1] int32`` on the model's device.
        max_seqlen: longest sequence length.
    """
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def _repeat_kv(x: Tensor, n_rep: int, head_dim: int) -> Tensor:
    """``[..., H_kv, ...]`` → ``[..., H_kv * n_rep, ...]`` along ``head_dim`` (each head repeated)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim)


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence.

    Args:
        query: ``[1, H, T, D]``; key, value: ``[1, H_kv, T, D]``.
        attention_mask: must be ``None`` (boundaries come from ``cu_seq_lens_q``).
        scaling: softmax scale (``None`` = ``1/sqrt(D)``).
        kwargs: ``cu_seq_lens_q`` ``[B+1] int32`` and ``max_length_q`` (see ``packed_kwargs``).

    Returns:
        ``([1, T, H, D], None)`` as transformers expects from an attention function.
    """
    cu = kwargs.get("cu_seq_lens_q")
    assert cu is not None, "packed attention needs cu_seq_lens_q; call the model with packed_kwargs(...)"
    assert query.shape[0] == 1, f"packed attention takes one packed row, got batch {query.shape[0]}"
    assert attention_mask is None, "packed attention takes no attention_mask"
    n_rep = query.shape[1] // key.shape[1]
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        q = query[0].transpose(0, 1)  # [T, H, D]
        k = _repeat_kv(key[0].transpose(0, 1), n_rep, 1)
        v = _repeat_kv(value[0].transpose(0, 1), n_rep, 1)
        max_len = int(kwargs["max_length_q"])
        cu32 = cu.to(torch.int32)
        out = varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scaling, window_size=(-1, 0))
        return out.unsqueeze(0), None
    k = _repeat_kv(key, n_rep, 1)
    v = _repeat_kv(value, n_rep, 1)
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scaling
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2), None


def use_packed_attention(model: torch.nn.Module) -> None:
    """Register ``"packed"`` with ``AttentionInterface`` (idempotent) and switch ``model`` to it."""
    AttentionInterface.register(NAME, packed_attention)
    model.set_attn_implementation(NAME)
