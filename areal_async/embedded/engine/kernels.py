"""Which kernels ``BatchedForward`` runs, chosen once at construction (``plan_kernels``).

A ``KernelPlan`` names, per forward phase, the linear (``F.linear`` or the batch-invariant
``tiled_linear``) and the attention path, plus whether a layer runs as the fused Triton
element-wise kernels and whether decode steps replay CUDA graphs. Nothing in it changes after
construction: the forward passes each phase its own linear.

The plan for each case (``bi``: ``batch_invariant``; "triton" needs Triton installed and a
power-of-two head dim ≥ 16; "fused" layers also need SiLU, HF RMSNorms and full-dim RoPE):

===================  ==============  =============  ============  ===========  ============  =====  ==========
case                 prefill linear  decode linear  prefill attn  decode attn  fused layers  fixed  cuda graph
===================  ==============  =============  ============  ===========  ============  =====  ==========
CPU fp32 / bf16      F.linear        F.linear       per_sequence  matmul       no            no     no
CPU bi               tiled_linear    tiled_linear   per_sequence  matmul       no            no     no
CUDA bf16 / fp16     F.linear        F.linear       varlen        triton       yes           no     if asked
CUDA bi (any dtype)  tiled_linear    F.linear       per_sequence  triton       yes           yes    if asked
CUDA fp32            F.linear        F.linear       per_sequence  triton       yes           no     if asked
===================  ==============  =============  ============  ===========  ============  =====  ==========

On CUDA without Triton (or a non-power-of-two head dim) decode attention is "matmul" and layers
are not fused. "varlen" prefill applies to a forward whose prompts have no cached prefix; one
with a prefix runs per sequence. "fixed" (``fixed_shape``): every decode step runs all slots over
the whole cache row. In batch-invariant mode decode attention always spans the whole cache row
(``full_span``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...batch_invariant import tiled_linear

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

PREFILL_ATTENTION = ("varlen", "per_sequence")
DECODE_ATTENTION = ("triton", "matmul")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The kernels of each forward phase (see the module's table).

    Attributes:
        prefill_linear: ``(x [T, K], weight [N, K], bias [N] | None) -> [T, N]`` for prefill.
        decode_linear: the same for decode steps.
        prefill_attention: ``"varlen"`` (one flash varlen call over the packed prompts) or
            ``"per_sequence"`` (causal SDPA per prompt).
        decode_attention: ``"triton"`` (one kernel reading each row's own positions; the KV cache
            stores keys untransposed) or ``"matmul"`` (masked softmax over a span).
        fused_layers: prefill and decode layers run as the fused Triton element-wise kernels.
        fixed_shape: every decode step runs all slots over the whole cache row (CUDA, batch-invariant).
        full_span: decode attention spans ``max_seq_len`` whatever the running rows (batch-invariant).
        cuda_graph: decode steps replay captured CUDA graphs (``DecodeGraphs``).
    """

    prefill_linear: Linear
    decode_linear: Linear
    prefill_attention: str
    decode_attention: str
    fused_layers: bool
    fixed_shape: bool
    full_span: bool
    cuda_graph: bool

    def __post_init__(self):
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention '{self.prefill_attention}' is not one of {PREFILL_ATTENTION}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention '{self.decode_attention}' is not one of {DECODE_ATTENTION}")


def plan_kernels(device_type: str, dtype: torch.dtype, batch_invariant: bool, head_dim: int, *,
                 triton_available: bool, fusable_layers: bool, cuda_graph: bool = True) -> KernelPlan:
    """The ``KernelPlan`` for a model on ``device_type`` (``"cpu"``, ``"cuda"``); touches no device.

    Args:
        device_type: ``torch.device.type`` of the model's parameters.
        dtype: the model's parameter dtype.
        batch_invariant: deterministic mode (each request's logits independent of the batch).
        head_dim: attention head dim (the Triton kernels need a power of two ≥ 16).
        triton_available: Triton is importable.
        fusable_layers: the model's layers fit the fused element-wise kernels (SiLU MLP, HF
            RMSNorms with a known epsilon, RoPE over the whole head dim).
        cuda_graph: replay captured decode graphs on CUDA (ignored elsewhere).
    """
    on_cuda = device_type == "cuda"
    pow2_dim = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    triton_attention = on_cuda and triton_available and pow2_dim
    half = dtype in (torch.bfloat16, torch.float16)
    return KernelPlan(
        prefill_linear=tiled_linear if batch_invariant else F.linear,  # CUDA too: fixed-row GEMM blocks
        decode_linear=tiled_linear if batch_invariant and not on_cuda else F.linear,  # CUDA: fixed shapes instead
        prefill_attention="varlen" if on_cuda and half and not batch_invariant else "per_sequence",
        decode_attention="triton" if triton_attention else "matmul",
        fused_layers=triton_attention and fusable_layers,
        fixed_shape=batch_invariant and on_cuda,
        full_span=batch_invariant,
        cuda_graph=on_cuda and cuda_graph,
    )
