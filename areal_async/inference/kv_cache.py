"""A preallocated, slot-based KV cache: one row of ``max_seq_len`` positions per running request.

Layout per layer: ``k, v: [S, Hkv, L, D]`` with S = ``max_running_requests`` slots, L =
``max_seq_len``. The scheduler keeps running requests packed in slots ``0..B-1`` (a finished
request's hole is filled by moving the last one in), so decode attends over the plain view
``k[:B, :, :len]`` without gathering. There is no paging and no prefix sharing: memory is
``2 * layers * S * Hkv * L * D * bytes`` up front (SmolLM2-135M, 32 × 1024, bf16: 755 MB).
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
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    def write_tokens(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store one token per row: ``k, v: [T, Hkv, D]`` at ``(slots[t], positions[t])`` (``[T] int64``)."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def view(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, batch)``, positions ``[0, length)``: ``[batch, Hkv, length, D]`` views."""
        return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        assert src != dst and 0 <= length <= self.max_seq_len, f"bad slot move {src}->{dst} ({length})"
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
