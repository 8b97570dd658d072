"""Batch-invariant building blocks for ``mode: deterministic`` (embedded engine and trainer).

A CPU GEMM's result for one row depends on how many rows the call has (M): the library picks its
blocking, and so the order of the K-reduction, from the shape. The same row can therefore come out
a few ulp different when a request is decoded alone, next to 3 others or next to 33 others, or
when a sequence is packed with different neighbours in a training micro-batch.

``tiled_linear`` removes that dependence: the rows are cut into blocks of exactly ``ROW_TILE``
rows (the last block zero-padded) and each block is one GEMM call of the same shape
``[ROW_TILE, K] @ [K, N]``. Measured on torch 2.13 CPU (MKL/oneDNN, fp32 and bf16, 1–2 threads):
a row's result in such a call does not depend on the other rows' values nor on its position in
the block, so every row's arithmetic is a function of that row alone (``tests/
test_batch_invariance.py`` checks it). Row-wise reductions (RMSNorm, softmax, log-softmax over the
last dimension) are already per-row in torch and need nothing.

On CUDA the block is ``CUDA_ROW_TILE`` rows: one GEMM per 16 rows would mean thousands of kernel
launches per training micro-batch, and a fixed-shape cuBLAS call picks the same kernel every time,
without a split of the K-reduction across blocks of rows (``tests/test_batch_invariance.py`` has
the same check, marked ``gpu``).

Cost: up to ``tile - 1`` padded rows per call and one call per block; see docs/determinism.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROW_TILE = 16
CUDA_ROW_TILE = 1024


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, tile: int | None = None) -> Tensor:
    """``F.linear`` computed in fixed blocks of ``tile`` rows, so each row's result is independent
    of how many rows ``x`` has and of their values.

    Args:
        x: ``[..., K]`` any float dtype; all leading dimensions are flattened into rows.
        weight: ``[N, K]``; bias: ``[N]`` or ``None``.
        tile: rows per GEMM call (``>= 1``); ``None``: ``ROW_TILE`` on CPU, ``CUDA_ROW_TILE`` on CUDA.

    Returns:
        ``[..., N]`` in ``x``'s dtype; differentiable (a ``cat`` of per-block results).
    """
    if tile is None:
        tile = CUDA_ROW_TILE if x.is_cuda else ROW_TILE
    assert tile >= 1, f"tile must be >= 1, got {tile}"
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = (-m) % tile
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    out = torch.cat([F.linear(rows[i : i + tile], weight, bias) for i in range(0, m + pad, tile)])
    return out[:m].reshape(*lead, weight.shape[0])


def _tiled_forward(module: nn.Linear, x: Tensor) -> Tensor:
    return tiled_linear(x, module.weight, module.bias)


def make_linears_batch_invariant(model: nn.Module) -> int:
    """Make every ``nn.Linear`` in ``model`` compute with ``tiled_linear``; returns how many.

    The modules keep their parameters (names, sharding, tying); only their ``forward`` changes.
    Call before wrapping the model (FSDP2/DDP) or after: the wrappers call the submodules.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_tiled_forward, module)
            count += 1
    return count
