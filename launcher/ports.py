"""The ports of a job: which config keys name one, free ones for the keys set to 0, and their record.

``PORT_KEYS`` (server i on ``inference.base_port + i``); ``choose_ports`` picks free ones, no two
equal; ``keys_to_choose`` says which (also on ``--resume``); ``write_record`` writes
``RUN_DIR/run.json``; ``is_bind_failure`` tells the launcher to retry once. docs/configuration.md#ports.
"""

from __future__ import annotations

import json
import pathlib
import re
import socket

import msgspec

from areal_async.config import Config

PORT_KEYS = ("inference.base_port", "queue.port", "trainer.master_port", "trainer.weight_sync_port")
RECORD = "run.json"
# how the processes of a job report a port another process took: the embedded server's check
# ("cannot listen on ... (Address already in use)"), asyncio's bind error (the queue), and
# c10d's TCPStore ("EADDRINUSE ... address already in use": torchrun's rendezvous, the weight group)
_BIND_FAILURE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)


def port_of(cfg: Config, key: str) -> int:
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def host_of(cfg: Config, key: str) -> str:
    """The address ``key``'s port is bound on: the servers', the queue's and the weight group's
    configured host (``trainer.weight_sync_host``); the trainer's rendezvous listens on the local
    machine."""
    return {"inference.base_port": cfg.inference.host, "queue.port": cfg.queue.host,
            "trainer.weight_sync_port": cfg.trainer.weight_sync_host}.get(key, "127.0.0.1")


def _width(cfg: Config, key: str) -> int:
    return cfg.inference.num_servers if key == "inference.base_port" else 1


def with_ports(cfg: Config, ports: dict[str, int]) -> Config:
    """``cfg`` with the dotted port keys of ``ports`` set."""
    for key, port in ports.items():
        section, field = key.split(".")
        cfg = msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section),
                                                                              **{field: port})})
    return cfg


def _bind_run(host: str, width: int, held: list[socket.socket], attempts: int = 100) -> int:
    """A port p with p .. p+width-1 all bindable on ``host`` now; their sockets are appended to
    ``held`` (the caller closes them once every port is chosen)."""
    for _ in range(attempts):
        first = socket.socket()
        first.bind((host, 0))
        base, run = first.getsockname()[1], [first]
        try:
            for port in range(base + 1, base + width):
                s = socket.socket()
                run.append(s)
                s.bind((host, port))
        except (OSError, OverflowError):
            for s in run:
                s.close()
            continue
        held.extend(run)
        return base
    raise OSError(f"found no {width} consecutive free ports on {host} in {attempts} attempts; set "
                  f"inference.base_port to a free port")


def choose_ports(cfg: Config, keys: tuple[str, ...]) -> tuple[Config, dict[str, int]]:
    """Free ports for ``keys`` (``inference.base_port``: ``inference.num_servers`` consecutive
    ones), none equal to another key's port. Returns the config with them set, and them."""
    held: list[socket.socket] = []
    chosen: dict[str, int] = {}
    try:
        for key in PORT_KEYS:  # the given ports are bound too, so that no chosen one equals them
            if key not in keys and port_of(cfg, key):
                for port in range(port_of(cfg, key), port_of(cfg, key) + _width(cfg, key)):
                    s = socket.socket()
                    held.append(s)
                    try:
                        s.bind((host_of(cfg, key), port))
                    except OSError:
                        pass  # in use: check_ports names it; here only no chosen port may equal it
        for key in keys:
            chosen[key] = _bind_run(host_of(cfg, key), _width(cfg, key), held)
    finally:
        for s in held:
            s.close()
    return with_ports(cfg, chosen), chosen


def read_record(run_dir: pathlib.Path) -> dict:
    """``RUN_DIR/run.json`` as a dict (``{}`` if the run has none or it is unreadable)."""
    try:
        return json.loads((pathlib.Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def keys_to_choose(cfg: Config, resume: bool) -> tuple[str, ...]:
    """The port keys the launcher picks: those set to 0 and, on ``resume``, those the stopped job
    chose whose number is given again (docs/configuration.md#ports)."""
    before = read_record(cfg.run_dir) if resume else {}
    again = {k for k in before.get("chosen", []) if before.get("ports", {}).get(k) == port_of(cfg, k)}
    return tuple(k for k in PORT_KEYS if port_of(cfg, k) == 0 or k in again)


def write_record(cfg: Config, chosen: tuple[str, ...]) -> None:
    """Write ``RUN_DIR/run.json`` (docs/configuration.md#ports shows it)."""
    record = {"ports": {k: port_of(cfg, k) for k in PORT_KEYS}, "server_urls": cfg.inference.urls(),
              "chosen": list(chosen)}
    (cfg.run_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def describe(cfg: Config, chosen: tuple[str, ...]) -> str:
    """One line naming every port, ``(chosen)`` beside the picked ones."""
    return ", ".join(f"{k}={port_of(cfg, k)}" + (" (chosen)" if k in chosen else "") for k in PORT_KEYS)


def is_bind_failure(message: str) -> bool:
    """Whether a failed process's message (``JobFailed``, with its last lines) says a port was taken."""
    return bool(_BIND_FAILURE.search(message))
