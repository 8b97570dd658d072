"""Facts about this machine that a config is checked against: ports, CUDA devices, CPU features.

- ``port_in_use``: whether ``host:port`` can be listened on now (the servers' check of ``--port``,
  the launcher's of the job's ports and hosts); ``free_port``: a port of 127.0.0.1 free now.
- ``cuda_index``: the CUDA device index a device string (``auto``, ``cpu``, ``cuda``, ``cuda:N``)
  resolves to, given whether torch sees CUDA.
- ``cpu_has_bf16``: whether this CPU computes bf16 natively.
- ``cuda_available``: ``torch.cuda.is_available()``, with torch imported only where a GPU driver
  may be.

Each is a plain function of plain values (a host, a device string, ``/proc/cpuinfo``, ``/dev``):
nothing here knows the config tree, and torch is imported only by ``cuda_available``. What the
launcher decides from these facts (``dtype: auto``, the tree attention path, the NCCL device rules)
is in ``launcher/resolve.py``; the free ports a job gets are chosen in ``launcher/ports.py``.
"""

from __future__ import annotations

import os
import pathlib
import platform
import socket
import sys

# Linux device nodes of a GPU driver: NVIDIA's control device, ROCm's kernel driver, WSL's GPU
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (the OS's reason), or ``None`` if it can. Bound with
    ``SO_REUSEADDR`` as the servers bind, so a port held only by connections in TIME_WAIT is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def free_port() -> int:
    """A port of 127.0.0.1 that is free now (bound as port 0, then released: another process may
    take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_available() -> bool:
    """``torch.cuda.is_available()``; on x86-64 Linux with none of ``GPU_DRIVER_NODES`` it is
    ``False`` without importing torch (~2 s of CPU in a launcher that needs nothing else of it). Not
    on ARM: a Jetson's integrated GPU has none of these nodes."""
    if sys.platform.startswith("linux") and platform.machine() == "x86_64" \
            and not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def cuda_index(key: str, device: str, cuda_available: bool) -> int | None:
    """The CUDA device index ``key``'s ``device`` resolves to (``None``: CPU).

    Raises:
        ValueError: not ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; CUDA asked for without one.
    """
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cpu":
        return None
    kind, _, index = device.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise ValueError(f"{key}={device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if not cuda_available:
        raise ValueError(f"{key}={device!r} but torch sees no CUDA device here; use {key}=cpu (or auto)")
    return int(index or 0)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it,
    slower than fp32 (measured on an AVX2-only EPYC: SmolLM2-135M decode 2.7× slower)."""
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
