"""SGLang's own code, run beside this project's, for the tests marked ``sglang_ref``.

SGLang 0.5.23's Python package lives in its own environment, ``.venv-sglang``
(``bash tools/sglang_ref/install.sh``; ``.ci/run`` builds it), with the torch it imports with, as a
real SGLang server keeps its own. Its code runs in that environment's Python (``run_sglang``: in
children forked from one server that has imported SGLang once per test process); a test that
needs it is skipped, with the reason and the command, when the environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support import REPO
from tests.support.sglang_zygote import ForkServer

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
SGLANG_VERSION = "0.5.23"

needs_sglang = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason=f"SGLang's own code is not installed ({SGLANG_PYTHON} is missing): bash tools/sglang_ref/install.sh",
)


# the test process's environment as it started: a variable another test (or a library it imports)
# sets in os.environ later must not turn every later call into a fresh process (see IMPORT_TIME_ENV)
_START_ENV = dict(os.environ)


def sglang_env(**extra: str) -> dict[str, str]:
    """Environment for a process of ``.venv-sglang``: the test process's environment at its start,
    with no CUDA and no inherited ``PYTHONPATH`` (this project's modules stay out of SGLang's
    interpreter unless a test adds them)."""
    env = {k: v for k, v in _START_ENV.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


# variables a process reads while it starts or imports (torch, CUDA, tokenizers, SGLang's own):
# a call whose environment differs from the fork server's in one of these gets a fresh process
IMPORT_TIME_ENV = ("CUDA_", "NVIDIA_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_", "SGLANG_", "SGL_",
                   "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "LD_", "MALLOC_")


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONPATH"}


ZYGOTE = ForkServer(SGLANG_PYTHON, sglang_env)


def run_sglang(code: str, payload=None, *, timeout: float = 120.0, env: dict[str, str] | None = None):
    """Run ``code`` in SGLang's interpreter as ``python -c`` would; ``payload`` goes in as JSON on
    stdin (read it with ``json.load(sys.stdin)``), and the last stdout line comes back parsed as JSON.

    The code runs in a child forked from ``ZYGOTE``, one server per test process (started on the
    first call) that has imported torch and SGLang's modules already, with ``env`` (default
    ``sglang_env()``) as its ``os.environ``, ``PYTHONPATH``'s entries on ``sys.path``, and the
    caller's working directory. Variables read at import time are the server's: where ``env``
    differs from the server's start environment in a variable matching ``IMPORT_TIME_ENV``
    (``CUDA_VISIBLE_DEVICES``, ``HF_*``, ``PYTHON*`` but ``PYTHONPATH``, ...), the call runs in a
    fresh process instead. Calls may come from several threads at once, each its own child.

    Raises:
        AssertionError: the code failed (its stderr's tail is in the message).
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (its process group killed).
    """
    env = env or sglang_env()
    if _import_time(env) != _import_time(ZYGOTE.server_env()):
        proc = subprocess.run([str(SGLANG_PYTHON), "-c", code], input=json.dumps(payload), capture_output=True,
                              text=True, timeout=timeout, env=env)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        rc, stdout, stderr = ZYGOTE.run(code, json.dumps(payload), env=env, timeout=timeout)
    assert rc == 0, f"SGLang-side process failed ({rc}):\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def popen_sglang(args: list[str], *, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start ``.venv-sglang/bin/python ARGS`` (e.g. ``["-m", "sglang.bench_serving", ...]``)."""
    return subprocess.Popen([str(SGLANG_PYTHON), *args], env=env or sglang_env(), **kw)


__all__ = ["SGLANG_PYTHON", "SGLANG_VERSION", "ZYGOTE", "needs_sglang", "popen_sglang", "run_sglang", "sglang_env"]
