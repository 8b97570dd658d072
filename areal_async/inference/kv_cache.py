"""A preallocated, slot-based KV cache: one row of ``max_seq_len`` positions per running request.

Layout per layer: keys transposed ``k: [S, Hkv, D, L]``, values ``v: [S, Hkv, L, D]``, with S =
``max_running_requests`` slots and L = ``max_seq_len``. The scheduler keeps running requests packed
in slots ``0..B-1`` (a finished request's hole is filled by moving the last one in), so decode
attends over the plain views ``k[:B, ..., :len]`` / ``v[:B, :, :len]`` without gathering; keys are
stored transposed so both attention matmuls read row-major operands (a sliced ``[len, D]`` key
block would be copied by CPU bf16 ``bmm``). There is no paging and no prefix sharing: memory is
``2 * layers * (S + 1) * Hkv * L * D * bytes`` up front (SmolLM2-135M, 32 × 1024, bf16: 778 MB).
Slot ``S`` (``scratch_slot``) belongs to no request: the padding rows of a fixed-shape decode step
(CUDA graphs, deterministic mode) write their keys and values there.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for ``num_slots`` sequences of up to ``max_seq_len`` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        rows = num_slots + 1  # + the scratch slot
        self.k = torch.zeros((num_layers, rows, num_kv_heads, head_dim, max_seq_len), dtype=dtype, device=device)
        self.v = torch.zeros((num_layers, rows, num_kv_heads, max_seq_len, head_dim), dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_seq_len = max_seq_len

    def token_index(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat element indices of tokens at ``(slots[t], positions[t])`` (``[T] int64`` each).

        Returns ``(k_index [T*Hkv*D], v_index [T*Hkv])``: into a layer's flattened keys, and into
        the rows of a layer's values viewed as ``[S*Hkv*L, D]``; both in ``[T, Hkv(, D)]`` order.
        """
        _, _, heads, dim, length = self.k.shape
        rows = slots[:, None] * heads + torch.arange(heads, device=slots.device)[None, :]  # [T, Hkv]
        dims = torch.arange(dim, device=slots.device)
        k_index = ((rows[:, :, None] * dim + dims) * length + positions[:, None, None]).flatten()
        return k_index, (rows * length + positions[:, None]).flatten()

    def write(self, layer: int, index: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [T, Hkv, D]`` at the places ``index`` (from ``token_index``) of ``layer``."""
        self.k[layer].view(-1).index_copy_(0, index[0], k.reshape(-1))
        self.v[layer].view(-1, v.shape[-1]).index_copy_(0, index[1], v.reshape(-1, v.shape[-1]))

    def view(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[batch, Hkv, D, length]`` (transposed) and values ``[batch, Hkv, length, D]`` of
        slots ``[0, batch)``, positions ``[0, length)``, as views."""
        return self.k[layer, :batch, :, :, :length], self.v[layer, :batch, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        assert src != dst and 0 <= length <= self.max_seq_len, f"bad slot move {src}->{dst} ({length})"
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
