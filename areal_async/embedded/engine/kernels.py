"""Which kernels ``BatchedForward`` runs, chosen once at construction (``plan_kernels``).

A frozen ``KernelPlan`` names each forward phase's linear and attention path, and whether layers
run the fused Triton kernels and decode steps replay CUDA graphs; nothing changes during a
forward. The plan for each device, dtype and mode: docs/engine.md#kernels-by-device-and-mode.
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
    """The kernels of each forward phase (the plan per case: docs/engine.md#kernels-by-device-and-mode).

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
