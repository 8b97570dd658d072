"""Packed (variable-length) causal attention for HF models, registered as ``"packed"``
(and ``"packed_repeat_kv"``, ``"packed_triton"``).

``use_packed_attention(model)`` registers the functions below with transformers'
``AttentionInterface`` and switches the model to one of them. The model is then called on one
packed row (batch size 1) with the boundaries as keyword arguments, which transformers forwards to
every attention layer::

    model(input_ids=ids[None], position_ids=pos[None], **packed_kwargs(batch))

Attention never crosses a sequence boundary:

- CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (flash varlen kernel) with
  ``window_size=(-1, 0)`` (causal); or, with ``backend="triton"`` (``trainer.attention_backend``),
  this project's Triton kernels (``trainer/triton_packed_attention.py``: FlashAttention-2 forward and a
  deterministic backward, native GQA).
- Otherwise (CPU, or fp32 anywhere): ``scaled_dot_product_attention`` with ``is_causal=True``
  applied to each sequence's slice in turn. This is the block-diagonal causal mask built from
  ``cu_seqlens``, evaluated block by block: the result is the same as with the full ``[T, T]``
  mask, but it costs Σ L_b² instead of T², which on a CPU is the difference between a cheap and
  an unusable training step for a 4k-token micro-batch.

Prefix trees (``trainer/tree.py``, shared-prefix packing): with ``tree_attention_kwargs`` the
row is a forest of token tries in pre-order and node ``i`` attends to node ``j`` iff
``j <= i < subtree_end[j]`` (its ancestors and itself). Three paths (``trainer.tree_attention``,
chosen by ``tree_paths.tree_attention_choice``; docs/trainer.md "Tree attention paths"):

- ``varlen``: the forest cut into chains (``tree.ChainLayout``: query run = a chain's own nodes,
  key run = its ancestors' K/V gathered with ``index_select``, then its own), and
  ``varlen_attn`` with separate ``cu_seqlens_q/k``, causal aligned to the bottom right (query
  ``i`` of a run of ``q`` reads the first ``k - q + i + 1`` keys: flash attention's alignment when
  the runs differ in length). The backward of ``index_select`` (an ``index_add``) sums the dK/dV
  of the gathered copies into the ancestor nodes. Off CUDA bf16/fp16 the kernel is stood in for
  by ``sdpa`` per run with that mask (``bottom_right_varlen_reference``), for checking.
- ``flex``: compiled FlexAttention (``torch.nn.attention.flex_attention``) with a block mask built
  once per micro-batch (CUDA bf16/fp16).
- ``sdpa``: ``sdpa`` per tree with the boolean ``[n, n]`` mask (CPU, fp32, deterministic).

Grouped-query attention: on the ``varlen_attn`` path K/V keep their ``H_kv`` heads (the flash
kernel maps query head ``h`` to K/V head ``h // (H / H_kv)``, and its backward sums the group's
dK/dV); ``use_packed_attention(model, native_gqa=False)`` selects ``"packed_repeat_kv"``, which
repeats K/V heads up to the query head count first, as the CPU path always does. Because
transformers only builds masks for the attention names it knows, no ``[T, T]`` mask is ever
created for either name.

Under ``torch.compile`` the per-sequence ``sdpa`` loop runs eagerly (``torch.compiler.disable``:
its Python loop over ``cu_seqlens`` values would otherwise specialise the graph on every packing);
``varlen_attn`` and the Triton attention are custom ops and stay in the graph.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import varlen
from transformers import AttentionInterface

from areal_async.trainer.tree_paths import TREE_PATHS
from areal_async.trainer.triton_packed_attention import varlen_attention

NAME = "packed"
REPEAT_KV_NAME = "packed_repeat_kv"
TRITON_NAME = "packed_triton"
BACKENDS = ("flash", "triton")
# torch 2.13 checks head counts unless ``enable_gqa=True``; releases without the flag pass
# K/V with fewer heads straight to the flash kernel.
_VARLEN_PARAMS = inspect.signature(varlen.varlen_attn).parameters
_GQA_FLAG = {"enable_gqa": True} if "enable_gqa" in _VARLEN_PARAMS else {}
# Causal ``varlen_attn``: torch 2.10+ (2.11 on the GPU machine, 2.13 here) take
# ``window_size=(-1, 0)`` and set ``is_causal`` from it; 2.9 took ``is_causal=True``. Either way
# the flash kernel's causal mask is aligned to the bottom right of each (q, k) run pair, which is
# what the tree path's gathered key runs need (for q == k runs the alignments coincide).
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}


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
    native_gqa: bool = True,
    backend: str = "flash",
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence.

    Args:
        query: ``[1, H, T, D]``; key, value: ``[1, H_kv, T, D]``.
        attention_mask: must be ``None`` (boundaries come from ``cu_seq_lens_q``).
        scaling: softmax scale (``None`` = ``1/sqrt(D)``).
        native_gqa: on the ``varlen_attn`` path, give the kernel K/V with ``H_kv`` heads
            (``False``: repeat them to ``H`` first). The ``sdpa`` path always repeats; the Triton
            kernels never do.
        backend: ``"flash"`` (``varlen_attn``) or ``"triton"``, for CUDA bf16/fp16 inputs; other
            inputs take the ``sdpa`` path whatever it says.
        kwargs: ``cu_seq_lens_q`` ``[B+1] int32`` and ``max_length_q`` (see ``packed_kwargs``).

    Returns:
        ``([1, T, H, D], None)`` as transformers expects from an attention function.
    """
    cu = kwargs.get("cu_seq_lens_q")
    assert cu is not None, "packed attention needs cu_seq_lens_q; call the model with packed_kwargs(...)"
    assert query.shape[0] == 1, f"packed attention takes one packed row, got batch {query.shape[0]}"
    assert attention_mask is None, "packed attention takes no attention_mask"
    n_rep = query.shape[1] // key.shape[1]
    subtree_end = kwargs.get("tree_subtree_end")
    if subtree_end is not None:
        chains = kwargs.get("tree_chains")
        if chains is not None:
            q = query[0].transpose(0, 1)  # [N, H, D]
            k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, H_kv, D]
            if not native_gqa:
                k, v = _repeat_kv(k, n_rep, 1), _repeat_kv(v, n_rep, 1)
            return varlen_tree_attention(q, k, v, chains, scaling).unsqueeze(0), None
        block_mask = kwargs.get("tree_block_mask")
        if block_mask is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
            return _flex_tree(query, key, value, block_mask, scaling, n_rep), None
        return _sdpa_per_tree(query, _repeat_kv(key, n_rep, 1), _repeat_kv(value, n_rep, 1), cu, subtree_end,
                              scaling), None
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q = query[0].transpose(0, 1)  # [T, H, D]
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H_kv, D]
        if backend == "triton":
            out = varlen_attention(q, k, v, cu.to(torch.int32), kwargs["max_length_q"], scaling)
            return out.unsqueeze(0), None
        gqa = {}
        if native_gqa and n_rep > 1:
            gqa = _GQA_FLAG
        else:
            k, v = _repeat_kv(k, n_rep, 1), _repeat_kv(v, n_rep, 1)
        max_len = kwargs["max_length_q"]
        cu32 = cu.to(torch.int32)
        out = varlen.varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scaling, **_CAUSAL, **gqa)
        return out.unsqueeze(0), None
    return _sdpa_per_sequence(query, _repeat_kv(key, n_rep, 1), _repeat_kv(value, n_rep, 1), cu, scaling), None


@torch.compiler.disable
def _sdpa_per_sequence(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float | None) -> Tensor:
    """``query, key, value [1, H, T, D]`` → ``[1, T, H, D]``: causal ``sdpa`` on each sequence's slice."""
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2)


def tree_attention_kwargs(cu_trees: Tensor, max_tree_len: int, subtree_end: Tensor, path: str = "sdpa",
                          chains=None) -> dict:
    """Keyword arguments that carry a forest of token tries (``trainer/tree.py``) through
    ``model(...)``: node ``i`` attends to node ``j`` iff ``j <= i < subtree_end[j]`` (its
    ancestors and itself; nodes in pre-order).

    Args:
        cu_trees: ``[K+1] int32`` tree boundaries, on the model's device.
        max_tree_len: nodes of the largest tree.
        subtree_end: ``[N] int64`` one past the last node of each node's subtree (global index).
        path: ``varlen``, ``flex`` or ``sdpa`` (``TREE_PATHS``; see the module docstring).
        chains: ``tree.ChainLayout`` of the forest on the model's device; needed by ``varlen``.

    Built once per micro-batch and shared by every layer: ``flex`` builds the FlexAttention block
    mask here (``tree_block_mask``); ``varlen`` passes ``chains`` (``tree_chains``).

    Raises:
        ValueError: ``path`` is not one of ``TREE_PATHS``, or ``varlen`` without ``chains``.
    """
    if path not in TREE_PATHS:
        raise ValueError(f"tree attention path {path!r} is unknown; use one of {', '.join(TREE_PATHS)}")
    kwargs = {**packed_kwargs(cu_trees, max_tree_len), "tree_subtree_end": subtree_end}
    if path == "flex":
        kwargs["tree_block_mask"] = tree_block_mask(subtree_end)
    elif path == "varlen":
        if chains is None:
            raise ValueError("tree attention path 'varlen' needs the forest's chain layout; build the batch "
                             "with pack_tree(..., attention='varlen')")
        kwargs["tree_chains"] = chains
    return kwargs


def varlen_tree_attention(q: Tensor, k: Tensor, v: Tensor, chains, scaling: float | None = None) -> Tensor:
    """Attention of every forest node over its ancestors and itself, through gathered key runs.

    Args:
        q: ``[N, H, D]`` per node; k, v: ``[N, H_kv, D]`` per node (``H % H_kv == 0``).
        chains: ``tree.ChainLayout`` on ``q``'s device: ``cu_q``/``cu_k`` ``[S+1] int32``,
            ``key_index`` ``[Σ k] int64``, ``max_q``/``max_k``.
        scaling: softmax scale (``None`` = ``1/sqrt(D)``).

    Returns:
        ``[N, H, D]``. K/V are gathered per layer (``index_select``; its backward sums the copies'
        gradients into the nodes); CUDA bf16/fp16 runs ``varlen_attn`` with separate query/key
        ``cu_seqlens`` and bottom-right causal alignment, anything else
        ``bottom_right_varlen_reference``.
    """
    kg, vg = k.index_select(0, chains.key_index), v.index_select(0, chains.key_index)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        gqa = _GQA_FLAG if q.shape[1] != k.shape[1] else {}
        return varlen.varlen_attn(q, kg, vg, chains.cu_q, chains.cu_k, chains.max_q, chains.max_k, scale=scaling,
                                  **_CAUSAL, **gqa)
    return bottom_right_varlen_reference(q, kg, vg, chains.cu_q, chains.cu_k, scaling)


@torch.compiler.disable
def bottom_right_varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                                  scaling: float | None = None) -> Tensor:
    """What ``varlen_attn(q, k, v, cu_q, cu_k, ..., window_size=(-1, 0))`` computes, by ``sdpa``
    per run pair: ``q [Tq, H, D]``, ``k, v [Tk, H_kv, D]`` → ``[Tq, H, D]``; query ``i`` of a run
    of ``lq`` reads keys ``0 … lk - lq + i`` of its run of ``lk`` (bottom-right causal). Costs
    Σ lq·lk; a stand-in for checking the tree path off CUDA, not a fast path."""
    n_rep = q.shape[1] // k.shape[1]
    outs = []
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = qe - qs, ke - ks
        mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        kk = _repeat_kv(k[ks:ke], n_rep, 1).transpose(0, 1)
        vv = _repeat_kv(v[ks:ke], n_rep, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), kk, vv, attn_mask=mask,
                                                   scale=scaling).transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def tree_mask_mod(subtree_end: Tensor):
    """FlexAttention ``mask_mod`` of a forest in pre-order: query node ``q`` reads key node ``kv``
    iff ``kv <= q < subtree_end[kv]`` (no tree boundary needed: no subtree crosses one)."""

    def ancestor_or_self(b, h, q, kv):
        return (kv <= q) & (q < subtree_end[kv])

    return ancestor_or_self


def tree_block_mask(subtree_end: Tensor):
    """FlexAttention ``BlockMask`` of ``tree_mask_mod`` over ``N`` nodes, built by a compiled
    kernel (blocks of 128 × 128 that no query of the block reads are skipped, the rest masked
    inside)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = subtree_end.numel()
    return create_block_mask(tree_mask_mod(subtree_end), None, None, n, n, device=subtree_end.device, _compile=True)


_COMPILED_FLEX = None


def _flex_tree(query: Tensor, key: Tensor, value: Tensor, block_mask, scaling: float | None, n_rep: int) -> Tensor:
    """``query [1, H, N, D]``, ``key, value [1, H_kv, N, D]`` → ``[1, N, H, D]``: compiled
    FlexAttention under the forest's block mask (native grouped-query attention)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:  # compiled on first use: flex attention's eager path is a slow reference
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    out = _COMPILED_FLEX(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=n_rep > 1)
    return out.transpose(1, 2)


@torch.compiler.disable
def _sdpa_per_tree(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, subtree_end: Tensor,
                   scaling: float | None) -> Tensor:
    """``query, key, value [1, H, N, D]`` → ``[1, N, H, D]``: ``sdpa`` on each tree's nodes with
    the boolean ancestor-or-self mask ``j <= i < subtree_end[j]`` (``[n, n]`` per tree, so the
    cost is Σ n_k², not N²)."""
    bounds = cu.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        idx = torch.arange(e - s, device=query.device)
        end = subtree_end[s:e] - s
        mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
        outs.append(F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                   attn_mask=mask, scale=scaling))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2)


def packed_attention_repeat_kv(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                               attention_mask: Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """``packed_attention`` with K/V heads always repeated to the query head count."""
    return packed_attention(module, query, key, value, attention_mask, scaling, dropout, native_gqa=False, **kwargs)


def packed_attention_triton(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """``packed_attention`` through the Triton kernels on CUDA (``backend="triton"``)."""
    return packed_attention(module, query, key, value, attention_mask, scaling, dropout, backend="triton", **kwargs)


def use_packed_attention(model: torch.nn.Module, native_gqa: bool = True, backend: str = "flash") -> None:
    """Register ``"packed"``, ``"packed_repeat_kv"`` and ``"packed_triton"`` with
    ``AttentionInterface`` (idempotent) and switch ``model`` to one: ``backend="triton"`` the last,
    else the first (``native_gqa``) or the second. May be called again to switch.

    Raises:
        ValueError: ``backend`` is not one of ``BACKENDS``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    AttentionInterface.register(NAME, packed_attention)
    AttentionInterface.register(REPEAT_KV_NAME, packed_attention_repeat_kv)
    AttentionInterface.register(TRITON_NAME, packed_attention_triton)
    model.set_attn_implementation(TRITON_NAME if backend == "triton" else NAME if native_gqa else REPEAT_KV_NAME)
