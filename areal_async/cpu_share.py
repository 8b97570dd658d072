"""Threads that follow who is computing: ``cpu_threads: adaptive`` (docs/running.md#adaptive-threads).

On a small CPU the servers and the trainer take turns more than they overlap: at η = 0 one waits
while the other computes, and at η ≥ 1 the faster one waits for the slower. With ``fixed`` threads
(``cpu_count // processes`` each) the waiting one's share of the cores lies idle. Here every server
and trainer rank owns one byte of a small shared file (the ledger, ``RUN_DIR/cpu_share``): 1 while
it computes, 0 while it waits. Before each piece of work (an engine step; a decoder layer's forward
or backward) a process sets its torch threads to its CPUs divided by the processes computing, itself
included: alone it takes every core, beside another it takes its share.

Simplifications: the ledger is read, not locked (a process that starts computing between another's
read and that one's next refresh runs one piece of work oversubscribed); a process that dies while
marked busy keeps its byte until it restarts and marks it again; the rollout workers, the queue and
reward functions are not counted (they compute little). Thread counts change the order of float
sums, so in ``mode: deterministic`` the threads stay fixed (``launcher/placement.check_adaptive``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pathlib

# the ledger's path and this process's slot, set by launcher.local for servers and trainer ranks (a
# rank's slot is the variable's value plus its LOCAL_RANK)
PATH_ENV = "AREAL_ASYNC_CPU_SHARE"
SLOT_ENV = "AREAL_ASYNC_CPU_SHARE_SLOT"


def create_ledger(path: str | os.PathLike, parties: int) -> pathlib.Path:
    """Write a ledger of ``parties`` idle slots (zero bytes) at ``path``; returns the path."""
    assert parties > 0, f"a ledger needs at least one party, got {parties}"
    path = pathlib.Path(path)
    path.write_bytes(bytes(parties))
    return path


class CpuShare:
    """This process's slot in a ledger: ``busy()``/``idle()`` mark it, ``refresh()`` sets the
    threads. ``cpus``: the CPUs to divide (default: this process's affinity)."""

    def __init__(self, path: str | os.PathLike, slot: int, cpus: int | None = None):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        if not 0 <= slot < len(self._map):
            raise ValueError(f"{SLOT_ENV}={slot}: the ledger {path} has slots 0..{len(self._map) - 1}; "
                             f"the launcher sets it, do not set it by hand")
        self.slot = slot
        self.cpus = cpus or len(os.sched_getaffinity(0))

    def busy(self) -> None:
        self._map[self.slot] = 1

    def idle(self) -> None:
        self._map[self.slot] = 0

    def computing(self) -> int:
        """How many parties are marked busy now (this one included if it is)."""
        return sum(self._map[:])

    def refresh(self) -> int:
        """Set this thread's torch threads to ``cpus // max(1, computing())`` (at least 1), calling
        ``torch.set_num_threads`` only on a change; returns the count. Call it on the thread that
        computes (MKL's count is per thread)."""
        import torch  # here, not at the top: the launcher imports this module and needs no torch

        threads = max(1, self.cpus // max(1, self.computing()))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    @contextlib.contextmanager
    def working(self):
        """Busy inside the block, threads refreshed on entry, idle after it (also after an exception)."""
        self.busy()
        self.refresh()
        try:
            yield self
        finally:
            self.idle()


def from_environment(environ=os.environ, local_rank: int = 0) -> CpuShare | None:
    """This process's ``CpuShare`` when the launcher gave it one (``PATH_ENV``), else ``None``."""
    path = environ.get(PATH_ENV, "")
    if not path:
        return None
    return CpuShare(path, int(environ.get(SLOT_ENV, "0")) + local_rank)


def refresh_around_layers(share: CpuShare, layers) -> int:
    """Refresh ``share`` before each of ``layers``' forward and before its backward (a hook on the
    gradient of its output), so that a long step follows who computes, layer by layer. Returns how
    many layers were hooked."""
    import torch

    def on_output(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(_refresh_on_grad)
        return None

    def _refresh_on_grad(grad):
        share.refresh()
        return None

    def before_forward(module, args):
        share.refresh()
        return None

    count = 0
    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(on_output)
        count += 1
    return count
