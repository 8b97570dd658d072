"""Sequence packing: 1-D token tensors with ``cu_seqlens``, and token-budgeted micro-batches.

A micro-batch is one row of concatenated sequences (no padding). ``cu_seqlens`` marks the
boundaries and position ids restart at 0 in every sequence, so rotary embeddings see each
sequence as if it were alone; the packed attention (``trainer/attention.py``) keeps attention
inside each sequence.

Micro-batches are as few as first-fit-decreasing bin packing needs under the token budget, and as
even as a longest-first greedy can make them (``allocate_micro_batches``): a batch of 68.8k tokens
under a 64k budget becomes two micro-batches of 34.4k, not 65.5k and 3.3k. The small one would cost
as many launches, FSDP gathers and host work per layer as a full one for a twentieth of the
arithmetic; on one H200 the 0.6B trainer ran 34.9 % MFU with 65.5k + 3.3k and 36.9 % with 36.9k +
32.0k (docs/performance.md, round 4). The allocation depends only on the lengths (ties broken by
index), never on timing, so a replayed run makes the same micro-batches. A sequence longer than the
budget is not an error: it gets a micro-batch of its own (its memory is bounded by
``inference.max_seq_len`` anyway).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated into one row.

    Fields:
        input_ids: ``[T] int64`` token ids of all sequences, back to back.
        position_ids: ``[T] int64`` position within its own sequence (restarts at 0).
        cu_seqlens: ``[B+1] int32`` cumulative lengths; sequence b is ``[cu[b], cu[b+1])``.
        max_seqlen: length of the longest sequence (int).
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> "PackedBatch":
        """The batch on ``device``; see ``to_device`` for ``non_blocking``."""
        return PackedBatch(*(to_device(t, device, non_blocking)
                             for t in (self.input_ids, self.position_ids, self.cu_seqlens)), self.max_seqlen)


def to_device(t: Tensor, device: torch.device | str, non_blocking: bool | None = None) -> Tensor:
    """``t`` on ``device``. ``non_blocking`` (default: when ``device`` is CUDA and ``t`` is on the
    CPU): copy from pinned memory without waiting, so the host goes on launching work while the GPU
    still runs the previous micro-batch. A plain ``.to("cuda")`` of pageable memory synchronises
    the stream first: every micro-batch would then start with the GPU idle until the host has
    launched its first kernels. The pinned staging buffer is kept alive by torch's caching host
    allocator until the copy has run."""
    device = torch.device(device)
    if non_blocking is None:
        non_blocking = device.type == "cuda" and t.device.type == "cpu"
    if non_blocking and t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def pack_sequences(seqs: list[list[int]]) -> PackedBatch:
    """Concatenate token-id lists into a ``PackedBatch``.

    Args:
        seqs: ``B`` non-empty lists of token ids.

    Returns:
        ``PackedBatch`` with ``T = Σ len(seqs[b])``.

    Raises:
        ValueError: ``seqs`` is empty or one sequence is empty (a sequence always holds its prompt).
    """
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [len(s) for s in seqs]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty; every sequence holds at least its prompt")
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), dim=0)
    return PackedBatch(input_ids, position_ids, cu_seqlens, max(lengths))


def allocate_micro_batches(lengths: list[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Balanced assignment of sequences to micro-batches under a token budget.

    1. ``k`` = the number of micro-batches first-fit-decreasing needs (``_first_fit_decreasing``).
    2. Longest first (equal lengths: lower index first), each sequence joins the least-loaded of
       ``k`` micro-batches (equal loads: the lowest-numbered), the greedy rule of Graham (1969)
       for even loads; an empty micro-batch takes any sequence, so one longer than the budget has
       a micro-batch of its own that nothing else joins.
    3. If a sequence does not fit in the least-loaded micro-batch, step 2 gives up and the
       first-fit-decreasing micro-batches are used as they are: never more micro-batches than
       first-fit-decreasing, balanced where the greedy rule finds a fit.

    Args:
        lengths: ``[B]`` token count of each sequence (prompt + response), each ``>= 1``.
        max_tokens_per_mb: token budget of one micro-batch, ``>= 1``.

    Returns:
        Micro-batches in creation order (step 2: the one the longest sequence joined first); each is
        a list of sequence indices in ascending order. Every index appears exactly once.

    Raises:
        ValueError: ``max_tokens_per_mb < 1`` or a length ``< 1``.
    """
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
    if lengths and min(lengths) < 1:
        raise ValueError(f"sequence lengths must be >= 1, got {min(lengths)}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packed = _first_fit_decreasing(lengths, order, max_tokens_per_mb)
    bins: list[list[int]] = [[] for _ in packed]
    loads = [0] * len(packed)
    for i in order:
        b = min(range(len(loads)), key=lambda j: (loads[j], j))
        if bins[b] and loads[b] + lengths[i] > max_tokens_per_mb:
            return packed
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def _first_fit_decreasing(lengths: list[int], order: list[int], max_tokens_per_mb: int) -> list[list[int]]:
    """First-fit-decreasing: in ``order`` (longest first), each sequence goes into the first
    micro-batch (in creation order) whose total stays ``<= max_tokens_per_mb``, else opens a new
    one. Micro-batches in creation order, indices ascending in each."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens_per_mb:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def assign_to_ranks(micro_batches: list[list[int]], world_size: int) -> list[list[list[int]]]:
    """Deal micro-batches round-robin to data-parallel ranks, padding with empty micro-batches.

    Every rank must run the same number of forward/backward passes (FSDP2 gathers parameters in
    each), so ranks that run out get ``[]`` — the trainer runs a zero-loss pass for those.

    Returns:
        ``[world_size][M]`` with ``M = ceil(len(micro_batches) / world_size)`` (at least 1).
    """
    assert world_size >= 1, f"world_size must be >= 1, got {world_size}"
    per_rank = max(1, -(-len(micro_batches) // world_size))
    padded = micro_batches + [[]] * (per_rank * world_size - len(micro_batches))
    return [padded[r::world_size] for r in range(world_size)]
