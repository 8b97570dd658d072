"""A preallocated, slot-based KV cache: one row of ``max_seq_len`` positions per running request.

Per layer, values ``[S + 1 + E, Hkv, L, D]`` and keys transposed, ``[S + 1 + E, Hkv, D, L]`` (the
matmul attention), or laid out like the values (the fused CUDA kernels): S request slots (running
requests in ``0..B-1``), the ``scratch_slot`` that padding rows write, then E ``prefix_rows`` of the
prefix cache, all allocated up front (no paging). Why these layouts, and sizes: docs/engine.md.
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
        keys_transposed: bool = True,
        prefix_rows: int = 0,
    ):
        rows = num_slots + 1 + prefix_rows  # + the scratch slot + the prefix cache's rows
        key_shape = (head_dim, max_seq_len) if keys_transposed else (max_seq_len, head_dim)
        self.k = torch.zeros((num_layers, rows, num_kv_heads, *key_shape), dtype=dtype, device=device)
        self.keys_transposed = keys_transposed
        self.v = torch.zeros((num_layers, rows, num_kv_heads, max_seq_len, head_dim), dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.prefix_rows = list(range(num_slots + 1, rows))
        self.max_seq_len = max_seq_len

    def token_index(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat element indices of tokens at ``(slots[t], positions[t])`` (``[T] int64`` each).

        Returns ``(k_index, v_index [T*Hkv])``: ``v_index`` into the rows of a layer's values
        viewed as ``[S*Hkv*L, D]``, in ``[T, Hkv]`` order; ``k_index`` the same for untransposed
        keys, and for transposed keys ``[T*Hkv*D]`` indices into the flattened layer, in
        ``[T, Hkv, D]`` order.
        """
        _, _, heads, length, dim = self.v.shape
        rows = slots[:, None] * heads + torch.arange(heads, device=slots.device)[None, :]  # [T, Hkv]
        v_index = (rows * length + positions[:, None]).flatten()
        if not self.keys_transposed:
            return v_index, v_index
        dims = torch.arange(dim, device=slots.device)
        k_index = ((rows[:, :, None] * dim + dims) * length + positions[:, None, None]).flatten()
        return k_index, v_index

    def write(self, layer: int, index: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [T, Hkv, D]`` at the places ``index`` (from ``token_index``) of ``layer``."""
        dim = v.shape[-1]
        if self.keys_transposed:
            self.k[layer].view(-1).index_copy_(0, index[0], k.reshape(-1))
        else:
            self.k[layer].view(-1, dim).index_copy_(0, index[0], k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, index[1], v.reshape(-1, dim))

    def view(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[batch, Hkv, D, length]`` (transposed, in either layout) and values
        ``[batch, Hkv, length, D]`` of slots ``[0, batch)``, positions ``[0, length)``, as views."""
        keys = self.k[layer, :batch, :, :, :length] if self.keys_transposed else \
            self.k[layer, :batch, :, :length].transpose(-1, -2)
        return keys, self.v[layer, :batch, :, :length]

    def row(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[Hkv, length, D]`` of positions ``[0, length)`` of one row, as views
        (the keys strided when they are cached transposed)."""
        keys = self.k[layer, row, :, :, :length].transpose(-1, -2) if self.keys_transposed else \
            self.k[layer, row, :, :length]
        return keys, self.v[layer, row, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (all layers): a slot
        compaction, or a cached prefix into (or out of) a slot."""
        assert src != dst and 0 <= length <= self.max_seq_len, f"bad slot move {src}->{dst} ({length})"
        if self.keys_transposed:
            self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        else:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
