"""A LoRA job on SGLang as the launcher and the job's processes set it up, stopped before anything
runs: the first inference server's command line (``server_argv``) and the keyword arguments of the
``InferenceClient``s the rollout worker and the trainer's evaluation build (``client_kwargs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import types

from areal_async.config import Config, load_config
from tests.support.jobs import TINY_JOB_CONFIG, tiny_job_overrides

LORA_SGLANG = ["trainer.lora.rank=4", "inference.backend=sglang", "trainer.weight_sync=disk",
               "inference.base_port=31000"]


class _Stop(Exception):
    """Raised by the stand-ins where the job would start something."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args_seen, self.kwargs_seen = args, kwargs


def lora_job(model_dir: pathlib.Path, run_root: pathlib.Path, *overrides: str) -> Config:
    """The tiny job with ``LORA_SGLANG`` and ``overrides``, its run directory created."""
    cfg = load_config(TINY_JOB_CONFIG, [*tiny_job_overrides(model_dir), f"run_root={run_root}", *LORA_SGLANG,
                                        *overrides])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return cfg


def server_argv(cfg: Config) -> list[str]:
    """``launcher.local.run_job``'s command line for ``server0`` (nothing is started)."""
    from launcher.local import run_job

    class Supervisor:
        env: dict = {}

        def start(self, name, argv, **kw):
            raise _Stop(name, argv)

    try:
        run_job(cfg, Supervisor())
    except _Stop as stop:
        assert stop.args_seen[0] == "server0"
        return stop.args_seen[1]
    raise AssertionError("run_job started no server")


def client_kwargs(cfg: Config, monkeypatch) -> dict[str, dict]:
    """``{"worker": kwargs, "trainer": kwargs}`` of the ``InferenceClient`` that
    ``rollout.worker.main`` and ``Coordinator.open`` (the evaluation's client) build for ``cfg``."""
    import areal_async.inference.client as client_module
    from areal_async.rollout import worker
    from areal_async.trainer.coordinator import Coordinator

    def stand_in(*args, **kwargs):
        raise _Stop(*args, **kwargs)

    monkeypatch.setattr(client_module, "InferenceClient", stand_in)
    seen = {}

    async def catch(name, run):
        try:
            await run
        except _Stop as stop:
            seen[name] = stop.kwargs_seen

    async def both():
        await catch("worker", worker.main(cfg, 0))
        async with contextlib.AsyncExitStack() as stack:
            await catch("trainer", Coordinator.open(cfg, cfg.run_dir, types.SimpleNamespace(start=0), stack, None))

    asyncio.run(both())
    assert set(seen) == {"worker", "trainer"}, seen
    return seen
