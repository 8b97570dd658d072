"""Which TCP addresses a process group makes this process listen on (gloo or NCCL).

    python tools/listening_sockets.py --backend nccl [--device cuda:0]
    NCCL_SOCKET_IFNAME=lo python tools/listening_sockets.py --backend nccl

Builds a one-rank weight-update group (``areal_async.weight_group.new_weight_group``, the store on
127.0.0.1, as the launcher's jobs do), runs one broadcast on it, then prints one line per TCP socket
this process listens on (``tests/support/listening.py``, from ``/proc``): its local address and whether it
is loopback only. Run from the repository root (``PYTHONPATH=.``). The store's own socket is on 127.0.0.1 by construction; what this
shows is where the backend's own sockets (NCCL's bootstrap and proxy, gloo's pairs) listen.
Prints the environment variables that steer them (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from tests.support.listening import listening, off_loopback


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--port", type=int, default=29731)
    args = p.parse_args()
    from areal_async.weight_group import broadcast_, new_weight_group

    device = torch.device(args.device if args.backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = new_weight_group(args.backend, "127.0.0.1", args.port, 0, 1)
    broadcast_(group, [torch.ones(4, device=device)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    env = {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    print(f"backend {args.backend}, env {env}")
    sockets = listening(os.getpid())
    outside = off_loopback(sockets)
    for address, port in sockets:
        where = "NOT loopback" if (address, port) in outside else "loopback"
        print(f"  listening on {f'{address}:{port}':<28} {where}")
    if not sockets:
        print("  no listening TCP socket found (is /proc/net/tcp readable here?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
