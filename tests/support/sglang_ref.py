"""SGLang's own code, run beside this project's, for the tests marked ``sglang_ref``.

SGLang 0.5.23's Python package lives in its own environment, ``.venv-sglang``
(``bash tools/sglang_ref/install.sh``; ``.ci/run`` builds it), with the torch it imports with, as a
real SGLang server keeps its own. Its code runs in subprocesses of that environment's Python; a
test that needs it is skipped, with the reason and the command, when the environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support import REPO

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
SGLANG_VERSION = "0.5.23"

needs_sglang = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason=f"SGLang's own code is not installed ({SGLANG_PYTHON} is missing): bash tools/sglang_ref/install.sh",
)


def sglang_env(**extra: str) -> dict[str, str]:
    """Environment for a process of ``.venv-sglang``: no CUDA, no inherited ``PYTHONPATH`` (this
    project's modules stay out of SGLang's interpreter unless a test adds them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_sglang(code: str, payload=None, *, timeout: float = 120.0, env: dict[str, str] | None = None):
    """Run ``code`` in SGLang's interpreter; ``payload`` goes in as JSON on stdin (read it with
    ``json.load(sys.stdin)``), and the last stdout line comes back parsed as JSON.

    Raises:
        AssertionError: the process failed (its stderr's tail is in the message).
    """
    proc = subprocess.run([str(SGLANG_PYTHON), "-c", code], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=timeout, env=env or sglang_env())
    assert proc.returncode == 0, f"SGLang-side process failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def popen_sglang(args: list[str], *, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start ``.venv-sglang/bin/python ARGS`` (e.g. ``["-m", "sglang.bench_serving", ...]``)."""
    return subprocess.Popen([str(SGLANG_PYTHON), *args], env=env or sglang_env(), **kw)


__all__ = ["SGLANG_PYTHON", "SGLANG_VERSION", "needs_sglang", "popen_sglang", "run_sglang", "sglang_env"]
