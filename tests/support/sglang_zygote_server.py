"""The fork server behind ``tests.support.sglang_ref.run_sglang``; runs in ``.venv-sglang``'s Python.

Started as ``python -c <this file's text> SOCKET``: imports torch and the SGLang modules the tests
use once, then listens on the Unix socket ``SOCKET`` and forks one child per connection. The parent
only accepts and reaps; it exits when the process that started it is gone.

Wire format: each message is an 8-byte big-endian length, then that many bytes of JSON.
child -> caller ``{"pid", "out", "err"}`` (its process group and its output files), caller -> child
``{"code", "payload", "env", "cwd"}``, child -> caller ``{"rc", "stdout", "stderr"}``.
"""

import json
import os
import signal
import socket
import struct
import sys

PRELOAD = (
    "torch", "transformers",
    "sglang.srt.server_args", "sglang.srt.managers.io_struct", "sglang.srt.managers.schedule_batch",
    "sglang.srt.sampling.sampling_params", "sglang.srt.lora.lora", "sglang.srt.lora.lora_config",
    "sglang.srt.lora.utils", "sglang.srt.configs.load_config", "sglang.srt.arg_groups.overrides",
    "sglang.srt.entrypoints.openai.protocol", "sglang.srt.entrypoints.openai.utils",
    "sglang.srt.model_executor.model_runner_components.weight_updater", "sglang.srt.utils.common",
    "sglang.srt.weight_sync.tensor_bucket", "sglang.api.v1.api_types",
)


def send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack(">Q", len(data)) + data)


def recv(conn: socket.socket):
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf
    return json.loads(exactly(struct.unpack(">Q", exactly(8))[0]))


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def preload() -> list[str]:
    """Import PRELOAD; returns the modules that failed to import."""
    import importlib
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # one missing module must not stop the others
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return failed


def run_child(conn: socket.socket) -> None:
    """In the forked child: read one request, run it as ``python -c`` would, reply; never returns."""
    import tempfile
    import traceback
    import types
    os.setpgid(0, 0)
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    me, real_exit = os.getpid(), os._exit
    out = tempfile.NamedTemporaryFile(prefix="sglang-out-", delete=False)
    err = tempfile.NamedTemporaryFile(prefix="sglang-err-", delete=False)

    def reply(rc) -> None:
        """Flush, send {rc, stdout, stderr}, remove the files, exit; in the code's own forks: just exit."""
        if os.getpid() != me:
            real_exit(rc)
        try:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            with open(out.name, encoding="utf-8", errors="replace") as f:
                stdout = f.read()
            with open(err.name, encoding="utf-8", errors="replace") as f:
                stderr = f.read()
            send(conn, {"rc": rc, "stdout": stdout, "stderr": stderr})
        except BaseException:
            pass  # the caller is gone or gave up; nothing to tell
        finally:
            for path in (out.name, err.name):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            real_exit(rc)

    try:
        send(conn, {"pid": me, "out": out.name, "err": err.name})
        req = recv(conn)
    except BaseException:
        reply(1)
    stdin = tempfile.TemporaryFile()
    stdin.write(req["payload"].encode())
    stdin.seek(0)
    os.dup2(stdin.fileno(), 0)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if req.get("cwd"):
        os.chdir(req["cwd"])
    sys.argv = ["-c"]
    os._exit = reply  # code that ends with os._exit still answers
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    rc = 1
    try:
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        rc = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:  # what a finishing interpreter does: wait for its threads, run its atexit functions
        import atexit
        import threading
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    reply(rc)


def serve(path: str) -> None:
    """Bind ``path`` first (callers may connect while the imports run), import, then fork per call.
    (No parent-death signal here: it would fire when the caller's thread that started us ends.)"""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    failed = preload()
    print(json.dumps({"ready": True, "threads": len(os.listdir("/proc/self/task")), "failed": failed}), flush=True)
    forks = 0
    listener.settimeout(0.5)
    while True:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            conn = None
        while True:  # reap finished children
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.getppid() != parent:
            os._exit(0)
        if conn is None:
            continue
        conn.settimeout(None)
        if forks == 0:  # torch's import leaves a native thread; fork copies only this one
            print(json.dumps({"threads_at_first_fork": len(os.listdir("/proc/self/task"))}), flush=True)
        forks += 1
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            run_child(conn)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
