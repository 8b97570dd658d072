"""Shared-prefix ("tree") packing: the sequences of a micro-batch as a forest of token tries.

``pack_tree`` sorts the sequences lexicographically (equal ones by index) into a ``TreeBatch``: one
node per distinct prefix, position id = depth, nodes in depth-first pre-order, trees marked by
``cu_trees``. ``unique_tokens`` (``Σ len − Σ lcp``) is what the allocator is charged; ``cut_units``
splits a tree over budget into runs of its sorted sequences; ``ChainLayout`` cuts the forest into
chains (a new one at each root and each child of a branching node) for ``varlen`` attention.
Invariants: node ``j`` is an ancestor-or-self of node ``i`` ⇔ ``j ≤ i < subtree_end[j]``, exactly
what node ``i`` attends to; no subtree crosses a tree boundary; position ``t`` of sequence ``s`` is
read from the node of its ``t``-th token with label ``s[t+1]``, so each sequence gets exactly its
own log-probs. Why and how, references, measurements: docs/trainer.md, "Exact savings" and "Tree
attention paths".
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from areal_async.trainer.attention import tree_attention_kwargs
from areal_async.trainer.packing import to_device
from areal_async.trainer.tree_paths import TREE_PATHS


@dataclasses.dataclass(frozen=True)
class ChainLayout:
    """The chains of a forest (see the module docstring), for ``attention.varlen_tree_attention``.

    Fields (``S`` chains):
        cu_q: ``[S+1] int32`` chain s's queries are nodes ``[cu_q[s], cu_q[s+1])``.
        cu_k: ``[S+1] int32`` its key run is rows ``[cu_k[s], cu_k[s+1])`` of ``key_index``.
        max_q, max_k: longest query run, longest key run (ints).
        key_index: ``[Σ k] int64`` node of each key row: per chain, its ancestors root first, then
            its own nodes.
    """

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    key_index: Tensor

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> "ChainLayout":
        """The layout on ``device`` (see ``packing.to_device``)."""
        return dataclasses.replace(self, **{name: to_device(getattr(self, name), device, non_blocking)
                                            for name in ("cu_q", "cu_k", "key_index")})


def chain_layout(parent: np.ndarray) -> ChainLayout:
    """The chains of a forest in pre-order given each node's parent.

    Args:
        parent: ``[N] int64`` parent node of each node, ``-1`` for a root; pre-order (a node's
            parent comes before it, a subtree is a run of nodes).

    Returns:
        ``ChainLayout``. A chain's ancestors are exactly the key run of its parent's chain (the
        parent, having several children or being the last of its chain's only children, ends its
        chain), so each key run is its parent chain's followed by its own nodes.

    Raises:
        ValueError: ``parent`` is not a forest in pre-order.
    """
    n = len(parent)
    if n == 0 or parent[0] != -1 or np.any(parent >= np.arange(n)):
        raise ValueError(f"parent must list a non-empty forest in pre-order (parent[i] < i, parent[0] = -1), "
                         f"got {parent[:8].tolist()}...; build it with pack_tree")
    children = np.bincount(parent[parent >= 0], minlength=n)
    starts = np.flatnonzero((parent < 0) | (children[np.maximum(parent, 0)] > 1))
    bounds = np.append(starts, n)
    inner = np.ones(n, dtype=bool)
    inner[starts] = False
    if not np.array_equal(parent[inner], np.flatnonzero(inner) - 1):
        raise ValueError("parent is not a forest in pre-order: a chain's node is not its predecessor's only child")
    chain_of = np.repeat(np.arange(len(starts)), np.diff(bounds))
    runs: list[np.ndarray] = []
    for c, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        own = np.arange(s, e, dtype=np.int64)
        runs.append(own if parent[s] < 0 else np.concatenate([runs[chain_of[parent[s]]], own]))
    q_lens, k_lens = np.diff(bounds), np.asarray([len(r) for r in runs])
    cum = lambda x: torch.from_numpy(np.concatenate([[0], np.cumsum(x)]).astype(np.int32))  # noqa: E731
    return ChainLayout(cu_q=cum(q_lens), cu_k=cum(k_lens), max_q=int(q_lens.max()), max_k=int(k_lens.max()),
                       key_index=torch.from_numpy(np.concatenate(runs)))


@dataclasses.dataclass(frozen=True)
class TreeBatch:
    """A micro-batch of sequences as a forest of tries (see the module docstring).

    Fields (``N`` nodes, ``K`` trees, ``T`` = Σ sequence lengths, ``M`` log-prob rows):
        input_ids: ``[N] int64`` token of each node, trees back to back, each in pre-order.
        position_ids: ``[N] int64`` depth of each node (its position in every sequence through it).
        subtree_end: ``[N] int64`` one past the last node of each node's subtree (global index).
        cu_trees: ``[K+1] int32`` tree k is nodes ``[cu_trees[k], cu_trees[k+1])``.
        max_tree_len: node count of the largest tree (int).
        head_nodes: ``[M] int64`` node whose hidden state predicts each log-prob row.
        head_labels: ``[M] int64`` the token it predicts.
        head_index: ``[M] int64`` where the row lands in the unshared layout (the sequences in the
            given order, back to back, ``T`` positions).
        num_seq_tokens: ``T`` (int).
        attention: tree attention path, ``varlen``, ``flex`` or ``sdpa`` (``tree_paths.TREE_PATHS``).
        chains: ``ChainLayout`` of the forest (``varlen`` only, else ``None``).
        cu_seqlens: ``[B+1] int32`` the sequences' boundaries in the unshared layout (as
            ``packing.PackedBatch``'s).
        behav_logprobs, advantages, loss_mask, versions: the per-token loss fields, ``[T]`` in the
            unshared layout, as ``packing.PackedBatch``'s (``None`` for a batch that only feeds a
            forward).
    """

    input_ids: Tensor
    position_ids: Tensor
    subtree_end: Tensor
    cu_trees: Tensor
    max_tree_len: int
    head_nodes: Tensor
    head_labels: Tensor
    head_index: Tensor
    num_seq_tokens: int
    attention: str = "sdpa"
    chains: ChainLayout | None = None
    cu_seqlens: Tensor | None = None
    behav_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    loss_mask: Tensor | None = None
    versions: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens through the model (nodes)."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> "TreeBatch":
        """The batch, loss fields included, on ``device`` (see ``packing.to_device``)."""
        moved = {f.name: to_device(getattr(self, f.name), device, non_blocking)
                 for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)}
        if self.chains is not None:
            moved["chains"] = self.chains.to(device, non_blocking)
        return dataclasses.replace(self, **moved)

    def model_inputs(self) -> dict:
        """Keyword arguments of the decoder: ``input_ids``/``position_ids`` ``[1, N]`` and the
        tree attention's boundaries (``attention.tree_attention_kwargs``)."""
        return {"input_ids": self.input_ids[None], "position_ids": self.position_ids[None],
                **tree_attention_kwargs(self.cu_trees, self.max_tree_len, self.subtree_end, self.attention,
                                        self.chains)}

    def head_rows(self) -> tuple[Tensor, Tensor, Tensor, int]:
        """``(rows [M], labels [M], out_index [M], out_len)``: hidden rows to put through the LM
        head, their labels, and where their log-probs go in the ``[T]`` output."""
        return self.head_nodes, self.head_labels, self.head_index, self.num_seq_tokens


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _sorted_with_lcp(seqs: list[list[int]]) -> tuple[list[int], list[int]]:
    """Lexicographic order of ``seqs`` (ties by index) and ``lcp[r]`` of each with the previous
    one in that order (``lcp[0] = 0``)."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i], i))
    arrays = [np.asarray(seqs[i], dtype=np.int64) for i in order]
    lcp = [0] + [_lcp(arrays[r - 1], arrays[r]) for r in range(1, len(order))]
    return order, lcp


def unique_tokens(seqs: list[list[int]]) -> int:
    """Nodes of the forest of ``seqs``: ``Σ len − Σ lcp`` over the sorted sequences."""
    order, lcp = _sorted_with_lcp(seqs)
    return sum(len(s) for s in seqs) - sum(lcp)


def cut_units(seqs: list[list[int]], max_tokens_per_mb: int) -> list[tuple[list[int], int]]:
    """Allocation units: the trees of ``seqs``, those over the budget cut into sub-trees.

    A tree is a maximal run of sorted sequences sharing at least their first token. One whose
    unique tokens exceed ``max_tokens_per_mb`` is cut into the fewest consecutive runs a greedy
    pass fills under the budget, and these as even as that count allows (the smallest run cap,
    by bisection, that still needs no more runs); every run repeats the prefix it shares. A
    single sequence longer than the budget is a unit of its own.

    Args:
        seqs: ``[B]`` token-id lists, each non-empty.
        max_tokens_per_mb: token budget of one micro-batch, ``>= 1``.

    Returns:
        ``(indices into seqs, unique-token cost)`` per unit, in sorted-sequence order. A function
        of the token ids only.
    """
    order, lcp = _sorted_with_lcp(seqs)
    lengths = [len(seqs[i]) for i in order]
    trees, start = [], 0
    for r in range(1, len(order) + 1):
        if r == len(order) or lcp[r] == 0:
            trees.append((start, r))
            start = r
    units = []
    for a, b in trees:
        cost = sum(lengths[a:b]) - sum(lcp[a + 1 : b])
        if cost <= max_tokens_per_mb:
            units.append((a, b, cost))
            continue
        runs = _greedy_runs(lengths, lcp, a, b, max_tokens_per_mb)
        lo, hi = -(-cost // len(runs)), max_tokens_per_mb
        while lo < hi:  # smallest cap with as few runs: the runs' costs as even as greedy makes them
            mid = (lo + hi) // 2
            if len(_greedy_runs(lengths, lcp, a, b, mid)) <= len(runs):
                hi = mid
            else:
                lo = mid + 1
        units += _greedy_runs(lengths, lcp, a, b, lo)
    return [(sorted(order[a:b]), cost) for a, b, cost in units]


def _greedy_runs(lengths: list[int], lcp: list[int], a: int, b: int, cap: int) -> list[tuple[int, int, int]]:
    """Consecutive runs ``(start, end, cost)`` of sorted sequences ``[a, b)``, each extended
    while its unique tokens stay ``<= cap`` (a sequence longer than ``cap`` alone)."""
    runs, start, cost = [], a, lengths[a]
    for r in range(a + 1, b):
        extra = lengths[r] - lcp[r]
        if cost + extra > cap:
            runs.append((start, r, cost))
            start, cost = r, lengths[r]
        else:
            cost += extra
    runs.append((start, b, cost))
    return runs


def pack_tree(seqs: list[list[int]], head_index: Tensor | None = None, attention: str = "sdpa") -> TreeBatch:
    """Build the forest of ``seqs`` (see the module docstring).

    Args:
        seqs: ``B`` non-empty token-id lists; the unshared layout is them back to back, in this
            order (``T`` = Σ len).
        head_index: ``[M] int64`` positions of the unshared layout whose next-token log-prob is
            wanted (the loss positions); ``None`` = every position that has a next token in its
            sequence.
        attention: the tree attention path the batch will take (``tree_paths.TREE_PATHS``);
            ``varlen`` also builds the chain layout (on the host, once per micro-batch).

    Returns:
        ``TreeBatch``.

    Raises:
        ValueError: ``seqs`` is empty, a sequence is empty, a ``head_index`` entry is not a
            position with a next token in its sequence, or ``attention`` is not a path.
    """
    if attention not in TREE_PATHS:
        raise ValueError(f"attention={attention!r} is not a tree attention path; use one of {', '.join(TREE_PATHS)}")
    if not seqs:
        raise ValueError("pack_tree needs at least one sequence")
    lengths = [len(s) for s in seqs]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty; every sequence holds at least its prompt")
    order, lcp = _sorted_with_lcp(seqs)
    node_of: list[np.ndarray | None] = [None] * len(seqs)
    tokens, depths, tree_starts = [], [], []
    subtree_end = np.zeros(sum(lengths) - sum(lcp), dtype=np.int64)
    parent = np.full(len(subtree_end), -1, dtype=np.int64)
    path = np.zeros(0, dtype=np.int64)  # nodes of the previous sequence, root first
    n = 0
    for r, i in enumerate(order):
        keep = lcp[r]
        subtree_end[path[keep:]] = n  # the previous path's nodes below the shared prefix end here
        if keep == 0:
            tree_starts.append(n)
        new = lengths[i] - keep
        seq = np.asarray(seqs[i], dtype=np.int64)
        tokens.append(seq[keep:])
        depths.append(np.arange(keep, lengths[i], dtype=np.int64))
        if new:
            parent[n] = path[keep - 1] if keep else -1
            parent[n + 1 : n + new] = np.arange(n, n + new - 1)
        path = np.concatenate([path[:keep], np.arange(n, n + new, dtype=np.int64)])
        node_of[i] = path
        n += new
    subtree_end[path] = n
    flat_nodes = np.concatenate(node_of)
    flat_ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    ends = np.cumsum(lengths)
    valid = np.ones(len(flat_ids), dtype=bool)
    valid[ends - 1] = False
    if head_index is None:
        rows = np.flatnonzero(valid)
    else:
        rows = head_index.cpu().numpy().astype(np.int64)
        bad = rows[(rows < 0) | (rows >= len(flat_ids))]
        bad = bad if bad.size else rows[~valid[rows]]
        if bad.size:
            raise ValueError(f"head_index {int(bad[0])} is not a position with a next token in its sequence "
                             f"(sequence ends: {ends.tolist()}); give loss positions only")
    cu_trees = torch.tensor(tree_starts + [n], dtype=torch.int32)
    return TreeBatch(
        input_ids=torch.from_numpy(np.concatenate(tokens)),
        position_ids=torch.from_numpy(np.concatenate(depths)),
        subtree_end=torch.from_numpy(subtree_end),
        cu_trees=cu_trees,
        max_tree_len=int(cu_trees.diff().max()),
        head_nodes=torch.from_numpy(flat_nodes[rows]),
        head_labels=torch.from_numpy(flat_ids[rows + 1]),
        head_index=torch.from_numpy(rows),
        num_seq_tokens=len(flat_ids),
        attention=attention,
        chains=chain_layout(parent) if attention == "varlen" else None,
        cu_seqlens=torch.tensor([0, *ends.tolist()], dtype=torch.int32),
    )
