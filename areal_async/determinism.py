"""Deterministic mode's process settings and its one exclusion, defined once (docs/determinism.md#how).

``deterministic_env``: ``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple`` (a fixed reduction order) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set before CUDA and NCCL start; values already set win.
``check_compile``: ``trainer.compile`` is refused (batch invariance is checked for eager kernels only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DETERMINISTIC_ENV: Mapping[str, str] = {
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}


def deterministic_env(mode: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a process of a job in ``mode`` (``config.Config.mode``) must have: in
    ``"deterministic"`` each of ``DETERMINISTIC_ENV``, its value in ``environ`` where set there,
    else the default; ``{}`` in any other mode."""
    if mode != "deterministic":
        return {}
    return {key: environ.get(key, default) for key, default in DETERMINISTIC_ENV.items()}


def check_compile(compile: bool, deterministic: bool) -> None:
    """Raise ``ValueError`` for ``trainer.compile=true`` in deterministic mode (the batch-invariant
    kernels are checked eagerly only)."""
    if compile and deterministic:
        raise ValueError("trainer.compile=true is not supported with mode: deterministic (batch-invariant "
                         "kernels are checked eagerly only); set trainer.compile=false")
