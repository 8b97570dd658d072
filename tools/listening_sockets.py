"""Which TCP addresses a process group makes this process listen on (gloo or NCCL).

    python tools/listening_sockets.py --backend nccl [--device cuda:0]
    NCCL_SOCKET_IFNAME=lo python tools/listening_sockets.py --backend nccl

Builds a one-rank weight-update group (``areal_async.weight_group.new_weight_group``, the store on
127.0.0.1, as the launcher's jobs do), runs one broadcast on it, then prints one line per TCP socket
this process listens on, read from ``/proc/self/fd`` and ``/proc/net/tcp{,6}``: its local address
and whether it is loopback only. The store's own socket is on 127.0.0.1 by construction; what this
shows is where the backend's own sockets (NCCL's bootstrap and proxy, gloo's pairs) listen.
Prints the environment variables that steer them (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

import torch


def _inodes() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def _address(hex_addr: str, family: int) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if family == socket.AF_INET:
        ip = socket.inet_ntop(family, raw[::-1])
    else:  # four little-endian 32-bit words
        ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port_hex, 16)}"


def listening() -> list[str]:
    """``ip:port`` of every TCP socket of this process in state LISTEN."""
    mine, found = _inodes(), []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in mine:  # 0A: LISTEN
                found.append(_address(cols[1], family))
    return found


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
    addrs = listening()
    for addr in addrs:
        host = addr.rsplit(":", 1)[0]
        loop = ipaddress.ip_address(host).is_loopback
        print(f"  listening on {addr:<28} {'loopback' if loop else 'NOT loopback'}")
    if not addrs:
        print("  no listening TCP socket found (is /proc/net/tcp readable here?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
