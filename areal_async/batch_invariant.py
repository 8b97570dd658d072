"""Batch-invariant linears for ``mode: deterministic`` (embedded engine and trainer).

A GEMM's per-row result depends on the call's row count (it picks the K-reduction order).
``tiled_linear`` runs blocks of exactly ``ROW_TILE`` rows (``CUDA_ROW_TILE`` on CUDA; the last
zero-padded), each one GEMM of one shape, so a row's result depends on that row alone
(``tests/test_batch_invariance.py``), at the cost of padding and one call per block. docs/determinism.md#how.
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
