"""CUDA-graph-captured decode steps for the embedded engine (``DecodeGraphs``).

A step of n running requests replays the graph of the smallest captured row count ``≥ n``
(``decode_bucket``), its extra rows padding that writes to the scratch slot (``padded_inputs``).
Graphs are captured on first use into one memory pool and read the weights that updates copy into
place, so nothing is recaptured. How: docs/engine.md#how-it-works; gain: docs/performance.md, round 3.
"""

from __future__ import annotations

import torch


def batch_sizes(max_rows: int) -> list[int]:
    """Captured row counts: 1, 2, 4, 8, then every multiple of 16 up to ``max_rows`` (and
    ``max_rows`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 16))
    return sorted(set(sizes) | {max_rows})


def decode_bucket(max_rows: int, max_seq_len: int, batch: int, span: int, length_step: int = 128) -> tuple[int, int]:
    """(rows, attention length) for ``batch`` running rows whose longest spans ``span`` positions:
    the smallest of ``batch_sizes(max_rows)`` ≥ ``batch``, and ``span`` rounded up to a multiple
    of ``length_step`` (at most ``max_seq_len``)."""
    rows = next(b for b in batch_sizes(max_rows) if b >= batch)
    return rows, min(max_seq_len, -(-span // length_step) * length_step)


def padded_inputs(tokens: torch.Tensor, positions: list[int], rows: int, scratch_slot: int, out: torch.Tensor) -> None:
    """Fill ``out[:, :rows]`` (``[3, ≥ rows] int64`` on the device) with the tokens, positions and
    cache slots of the n running rows (slot b for row b), then padding rows (token 0, position 0,
    the scratch slot).

    ``tokens: [n] int64`` is on the device (the engine's last sampled tokens, possibly not computed
    yet): copied device to device in stream order. Positions and slots are host ints, staged in
    pinned memory on CUDA so that the host-to-device copy waits for nothing.
    """
    n, pad = len(positions), rows - len(positions)
    host = torch.tensor([positions + [0] * pad, list(range(n)) + [scratch_slot] * pad], pin_memory=out.is_cuda)
    out[1:, :rows].copy_(host, non_blocking=True)
    out[0, :n].copy_(tokens)
    out[0, n:rows].zero_()


class DecodeGraphs:
    """Capture and replay a decode step (CUDA only).

    Args:
        step: the eager decode step ``(tokens, positions, slots: [rows] int64, length: int,
            out: [rows, V] float32) -> logits`` that is captured (``BatchedForward._decode_step``);
            the caller picks each step's (rows, length) with ``decode_bucket``.
        cache: the ``KVCache`` it reads and writes (``num_slots`` rows at most; padding rows write
            its ``scratch_slot``).
        vocab_size: V, the logits' width.
        device: the CUDA device the step runs on.
    """

    def __init__(self, step, cache, vocab_size: int, device: torch.device):
        self.step, self.cache, self.device = step, cache, device
        self.max_rows = cache.num_slots
        self.inputs = torch.zeros(3, self.max_rows, dtype=torch.int64, device=device)
        self.logits = torch.empty(self.max_rows, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _capture(self, rows: int, length: int) -> torch.cuda.CUDAGraph:
        self.inputs[0, :rows] = 0
        self.inputs[1, :rows] = 0
        self.inputs[2, :rows] = self.cache.scratch_slot  # capture-time rows write only the scratch slot
        args = (self.inputs[0, :rows], self.inputs[1, :rows], self.inputs[2, :rows], length, self.logits[:rows])
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the capture: lazy library initialisation
            self.step(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(*args)
        self.pool = graph.pool()
        return graph

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: list[int], rows: int, length: int) -> torch.Tensor:
        """Replay the ``(rows, length)`` graph (capturing it first if new) for the n running slots.

        Args:
            tokens: ``[n] int64`` on the device, each slot's last sampled token.
            positions: n ints, each slot's input position.
        Returns:
            logits ``[n, V] float32``, a view of the shared buffer (valid until the next replay).
        """
        graph = self.graphs.get((rows, length))
        if graph is None:
            graph = self.graphs[(rows, length)] = self._capture(rows, length)
        padded_inputs(tokens, positions, rows, self.cache.scratch_slot, self.inputs)
        graph.replay()
        return self.logits[: len(positions)]
