"""Python code run in a limited subprocess: ``await run_python(code, seed, limits)``.

The child is ``sys.executable -s -P -B -u -c RUNNER`` (isolated as ``-I`` is, but with ``-E``
left out so that ``PYTHONHASHSEED`` is honoured) leading a new process group, in a fresh
temporary working directory (removed afterwards) and a minimal environment. ``RUNNER`` reads the
code from stdin, then, before the code runs: sets RLIMIT_CPU, RLIMIT_AS and RLIMIT_FSIZE; tries
``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` (no network at all where permitted); installs an audit
hook refusing ``socket.*``, process creation (and importing ``_posixsubprocess``),
``os.kill``/``os.killpg`` and ``ctypes.*`` events (a guard against accidents, not a security
boundary: the limits and the namespace are the kernel's); calls ``random.seed(seed)``. A write
past ``max_file_bytes`` raises ``OSError`` (EFBIG) in the code. stdout and stderr share one pipe,
read up to ``max_output_bytes``.

``SandboxResult.error``: ``None`` (exit status 0), ``"raised"`` (an exception or a nonzero exit),
``"memory"`` (MemoryError under RLIMIT_AS), ``"timeout"`` (wall clock), ``"output_limit"``,
``"cpu_time"`` (SIGXCPU), ``"killed"`` (another signal, or never reaped), ``"code_size"`` (over
``max_code_bytes``, not run), ``"start"`` (the interpreter could not be started). On timeout,
output flood or cancellation the whole process group gets SIGKILL. ``run_python`` never raises
for the code's own failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import signal
import sys
import tempfile
import time

__all__ = ["EXIT_MEMORY", "SandboxLimits", "SandboxResult", "run_python"]

EXIT_MEMORY = 86  # the runner's exit status after a MemoryError
TRUNCATED = "\n[output truncated at {n} bytes]"
_KILL_GRACE_S = 5.0  # waiting for a SIGKILLed process group's leader to be reaped

# The child's preamble; argv: seed, cpu seconds, address-space bytes, file-size bytes.
RUNNER = r'''
import sys
def _main():
    import linecache, os, random, resource, traceback
    code = sys.stdin.read()
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    seed, cpu_s, as_bytes, fsize = (int(a) for a in sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)
    except Exception:
        pass
    resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    refused = ("socket.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn",
               "os.spawn", "os.system", "os.kill", "os.killpg", "pty.spawn", "ctypes.",
               "signal.pthread_kill")
    def hook(event, args):
        if event.startswith(refused) or (event == "import" and args[0] == "_posixsubprocess"):
            raise PermissionError(f"refused in the sandbox: {event}")
    sys.addaudithook(hook)
    random.seed(seed)
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit:
        raise
    except MemoryError:
        try:
            sys.stdout.flush()
            sys.stderr.write("MemoryError: out of memory\n")
            sys.stderr.flush()
        finally:
            os._exit(86)
    except BaseException as e:
        sys.stdout.flush()
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)
_main()
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits: ``timeout_s`` wall seconds, ``cpu_s`` CPU seconds (default: ``timeout_s`` rounded
    up, plus 1, so that the wall clock ends a busy loop first), ``memory_mb`` address space in
    MiB, ``max_output_bytes`` stdout+stderr bytes kept, ``max_file_bytes`` size of any file
    written, ``max_code_bytes`` size of the code."""

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_bytes: int = 1 << 20
    max_code_bytes: int = 100_000


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """``stdout``: the child's stdout and stderr as text (UTF-8, bad bytes replaced; ends with
    ``TRUNCATED`` when over the cap); ``error``: the kind (module docstring) or ``None``;
    ``exit_status``: the return code (negative: the signal) or ``None`` if it never started;
    ``seconds``: wall time."""

    stdout: str
    error: str | None
    exit_status: int | None
    seconds: float


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    """Remove ``path`` even where the code took away permissions inside it."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                try:
                    os.chmod(os.path.join(root, d), 0o700)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)


def _error_kind(status: int) -> str | None:
    if status == 0:
        return None
    if status == EXIT_MEMORY:
        return "memory"
    if status > 0:
        return "raised"
    return "cpu_time" if -status == signal.SIGXCPU else "killed"


async def _read_capped(stream: asyncio.StreamReader, cap: int, out: bytearray) -> bool:
    """Read ``stream`` into ``out`` until EOF (``False``) or past ``cap`` bytes (``True``)."""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return False
        out += chunk
        if len(out) > cap:
            return True


async def _reap(proc: asyncio.subprocess.Process, timeout_s: float) -> int | None:
    """``proc``'s exit status, or ``None`` after ``timeout_s``. asyncio's ``wait()`` returns once
    the stdout pipe is closed too, so what a flood left in it is read and dropped."""

    async def drain():
        while await proc.stdout.read(65536):
            pass

    try:
        return (await asyncio.wait_for(asyncio.gather(drain(), proc.wait()), timeout_s))[1]
    except asyncio.TimeoutError:
        return None


async def run_python(code: str, seed: int = 0, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a limited subprocess with ``random.seed(seed)`` and
    ``PYTHONHASHSEED=seed mod 2**32``; the result's ``error`` says how it ended.

    Raises only ``asyncio.CancelledError`` (the process group killed first)."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    data = code.encode("utf-8", "replace")
    if len(data) > limits.max_code_bytes:
        return SandboxResult(f"code too long: {len(data)} bytes, the limit is {limits.max_code_bytes}",
                             "code_size", None, 0.0)
    workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": str(seed % 2**32), "PYTHONIOENCODING": "utf-8"}
    cpu_s = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1
    argv = [sys.executable, "-s", "-P", "-B", "-u", "-c", RUNNER, str(seed), str(cpu_s),
            str(limits.memory_mb << 20), str(limits.max_file_bytes)]
    proc = None
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True,
                close_fds=True)
        except OSError as e:
            return SandboxResult(f"could not start python: {e}", "start", None, time.monotonic() - start)
        out = bytearray()
        error = None

        async def feed_and_read() -> bool:
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            return await _read_capped(proc.stdout, limits.max_output_bytes, out)

        try:
            if await asyncio.wait_for(feed_and_read(), limits.timeout_s):
                error = "output_limit"
        except asyncio.TimeoutError:
            error = "timeout"
        if error is not None:
            _kill_group(proc.pid)
        remaining = max(0.1, limits.timeout_s - (time.monotonic() - start))
        status = await _reap(proc, remaining if error is None else _KILL_GRACE_S)
        if status is None:  # stdout closed but the process lingers
            _kill_group(proc.pid)
            error = error or "timeout"
            status = await _reap(proc, _KILL_GRACE_S)
        text = bytes(out[:limits.max_output_bytes]).decode("utf-8", "replace")
        if len(out) > limits.max_output_bytes:
            text += TRUNCATED.format(n=limits.max_output_bytes)
        kind = error or (_error_kind(status) if status is not None else "killed")
        return SandboxResult(text, kind, status, time.monotonic() - start)
    finally:
        if proc is not None and proc.returncode is None:  # cancelled, or never reaped
            _kill_group(proc.pid)
            try:
                await _reap(proc, _KILL_GRACE_S)
            except asyncio.CancelledError:
                pass
        _remove_tree(workdir)
