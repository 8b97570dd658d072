"""A fork server in another Python environment: its imports paid once, each call a fresh fork.

``ForkServer(python, make_env)`` starts ``python -c <sglang_zygote_server.py> SOCKET`` with
``make_env()`` on its first ``run`` (its own process group, stdin closed, output to a log file) and
kills that group, and any call still running, when this interpreter exits.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

SERVER_SOURCE = Path(__file__).with_name("sglang_zygote_server.py")


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack(">Q", len(data)) + data)


def _recv(conn: socket.socket):
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = conn.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the fork server closed the connection")
            buf += chunk
        return bytes(buf)
    return json.loads(exactly(struct.unpack(">Q", exactly(8))[0]))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class ForkServer:
    """One lazily started fork server; ``run`` is safe to call from several threads at once."""

    def __init__(self, python: Path, make_env: Callable[[], dict[str, str]]):
        self.python, self.make_env = python, make_env
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] | None = None
        self._dir: str | None = None
        self._children: set[int] = set()
        atexit.register(self.stop)

    def server_env(self) -> dict[str, str]:
        """The environment the server started (or will start) with."""
        with self._lock:
            return dict(self._env) if self._env is not None else self.make_env()

    @property
    def log(self) -> str:
        """The server's own stdout and stderr (its start-up line: ready, threads, failed imports)."""
        return os.path.join(self._dir, "server.log") if self._dir else ""

    def _socket(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop_locked()
                self._dir = tempfile.mkdtemp(prefix="sglang-zygote-")
                self._env = self.make_env()
                path = os.path.join(self._dir, "s")
                with open(self.log, "w") as log:
                    self._proc = subprocess.Popen(
                        [str(self.python), "-c", SERVER_SOURCE.read_text(), path], env=self._env,
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                deadline = time.monotonic() + 60
                while not os.path.exists(path):  # it binds before it imports
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"the SGLang fork server did not start:\n{_tail(self.log)}")
                    time.sleep(0.02)
            return os.path.join(self._dir, "s")

    def run(self, code: str, payload: str, *, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """Run ``code`` in a forked child with ``payload`` as its stdin; returns (rc, stdout, stderr).

        Raises:
            subprocess.TimeoutExpired: past ``timeout`` seconds (counting the server's imports on the
                first call); the child's process group is killed first.
        """
        deadline = time.monotonic() + timeout
        path = self._socket()
        child = None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            try:
                conn.connect(path)
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                child = _recv(conn)
                with self._lock:
                    self._children.add(child["pid"])
                _send(conn, {"code": code, "payload": payload, "env": env, "cwd": os.getcwd()})
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                reply = _recv(conn)
                return reply["rc"], reply["stdout"], reply["stderr"]
            except (socket.timeout, TimeoutError):
                if child is not None:
                    _kill_group(child["pid"])
                raise subprocess.TimeoutExpired(f"SGLang-side code (forked child {child and child['pid']})",
                                                timeout, stderr=child and _tail(child["err"])) from None
            except (EOFError, ConnectionError) as e:
                tail = _tail(child["err"]) if child else _tail(self.log)
                raise AssertionError(f"the SGLang fork server or its child failed ({e}):\n{tail}") from None
            finally:
                if child is not None:
                    with self._lock:
                        self._children.discard(child["pid"])
                    for name in (child["out"], child["err"]):  # left behind by a child that was killed
                        try:
                            os.unlink(name)
                        except OSError:
                            pass

    def _stop_locked(self) -> None:
        for pid in self._children:
            _kill_group(pid)
        self._children.clear()
        if self._proc is not None:
            _kill_group(self._proc.pid)
            self._proc.wait()
            self._proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def stop(self) -> None:
        """Kill the server's process group and every call still running."""
        with self._lock:
            self._stop_locked()
