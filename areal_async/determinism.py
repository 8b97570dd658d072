"""Deterministic mode's process settings and its one exclusion, defined once.

``deterministic_env``: the environment a job's processes need in ``mode: deterministic``, set
before CUDA and NCCL initialise: ``NCCL_ALGO=Ring`` / ``NCCL_PROTO=Simple`` (one algorithm and
protocol, so collectives such as the trainer's all-reduce and the weight broadcast reduce in a
fixed order) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (which cuBLAS needs for
``torch.use_deterministic_algorithms(True)``). The launcher gives it to the servers and the
trainer; the trainer applies it again itself, so a trainer started by hand gets it too. Values
already in the environment win.

``check_compile``: ``trainer.compile`` is refused in deterministic mode (the batch-invariant
linears are checked for eager kernels only); the config check and ``build_policy`` both call it.
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
