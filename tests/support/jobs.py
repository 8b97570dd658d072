"""Small end-to-end jobs through the launcher, for the tests that run whole jobs.

- The determinism job (``job_argv``, ``run_job``; ``start_job`` and ``finish_job`` to run several
  side by side): ``mode`` deterministic or throughput, η = 1, 2 embedded servers, 2 workers, a
  2-rank trainer, the tiny model, random timing jitter seeded by ``jitter_seed``; ``fingerprint``
  reads what must be identical across two such runs, ``JobRuns`` keeps one per mode and seed.
- The tiny job (``TINY_JOB_CONFIG`` with ``tiny_job_overrides``): seconds long, every port chosen
  at start.
- ``stop_and_read``: stop a launcher started with ``subprocess.Popen`` and read its output.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from safetensors.torch import load_file

from areal_async.trainer.checkpoint import state_dict_sha256
from tests.support import REPO

STEPS = 4
# Wall-clock timings (seconds in tools and environments, from a group's lease to its end), and
# snapshots of the queue taken while workers race on (how many groups happen to be ready/running
# at the moment of logging): observations of timing, not results.
TIMING_KEYS = {"time", "rollout/tokens_per_s", "rollout/env_s", "rollout/episode_s", "queue/ready", "queue/running",
               "queue/capacity"}


def job_argv(model_dir: pathlib.Path, run_root: pathlib.Path, name: str, mode: str, jitter_seed: int,
             steps: int = STEPS, resume: bool = False, jitter_ms: float = 20,
             extra: tuple[str, ...] = (), launcher: str = "local") -> list[str]:
    """The ``launcher.<launcher>`` command line of ``run_job`` (same arguments)."""
    overrides = [
        f"name={name}", f"run_root={run_root}", "seed=3", f"mode={mode}",
        f"model.path={model_dir}", "model.dtype=float32", "data.max_prompt_len=400",
        "inference.num_servers=2",
        "inference.max_seq_len=512", "inference.threads=1", "inference.max_running_requests=8",
        "rollout.num_workers=2", "rollout.n_samples=4", "rollout.max_new_tokens=12",
        "rollout.max_groups_in_flight=2",
        "queue.batch_size=2", "queue.max_staleness=1", "queue.max_concurrent=4",
        "trainer.nproc=2", f"trainer.total_steps={steps}", "trainer.lr=1e-3", "trainer.weight_decay=0",
        "eval.at_start=false", "eval.at_end=false", "eval.max_new_tokens=8",
        "reward.fn=tests.support.parity_reward:even_length",
        "logging.wandb_mode=disabled", "logging.dump_trajectories=true",
        f"debug.jitter_ms={jitter_ms}", f"debug.jitter_seed={jitter_seed}", *extra,
    ]
    flags = ["--resume"] if resume else []
    return [sys.executable, "-m", f"launcher.{launcher}", "configs/gsm8k_smollm2.yaml", *overrides, *flags]


def run_job(model_dir: pathlib.Path, run_root: pathlib.Path, name: str, mode: str, jitter_seed: int,
            steps: int = STEPS, resume: bool = False, jitter_ms: float = 20,
            extra: tuple[str, ...] = (), launcher: str = "local") -> pathlib.Path:
    """Run one job of ``steps`` steps through ``launcher.<launcher>`` (``resume``: continue the run
    ``name`` from its checkpoint; ``extra``: more overrides); returns its run directory (asserts
    exit 0)."""
    return finish_job(start_job(model_dir, run_root, name, mode, jitter_seed, steps, resume, jitter_ms, extra,
                                launcher), run_root, name)


def start_job(model_dir: pathlib.Path, run_root: pathlib.Path, name: str, *args, **kwargs) -> subprocess.Popen:
    """Start ``run_job``'s job (same arguments) in the background, its output in
    ``run_root/<name>.out``; ``finish_job`` waits for it."""
    argv = job_argv(model_dir, run_root, name, *args, **kwargs)
    with (run_root / f"{name}.out").open("w") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)


def finish_job(proc: subprocess.Popen, run_root: pathlib.Path, name: str, timeout_s: float = 300) -> pathlib.Path:
    """Wait for the job ``start_job`` started (killed after ``timeout_s``); returns its run
    directory (asserts exit 0)."""
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (run_root / f"{name}.out").read_text()[-6000:]
    return run_root / name


class JobRuns(dict):
    """``runs[mode, jitter_seed]``: the ``fingerprint`` of that undisturbed ``run_job`` job under
    ``root`` (``steps``: per mode, else ``STEPS``; ``extra``: more overrides), run on first use;
    ``start`` runs jobs side by side ahead of their use; ``close`` kills those never used."""

    def __init__(self, model_dir: pathlib.Path, root: pathlib.Path, steps: dict[str, int] | None = None,
                 extra: tuple[str, ...] = ()):
        super().__init__()
        self._model_dir, self._root, self._steps, self._extra = model_dir, root, steps or {}, extra
        self._started: dict[tuple[str, int], subprocess.Popen] = {}

    def start(self, *keys: tuple[str, int]) -> None:
        for mode, seed in keys:
            if (mode, seed) not in self and (mode, seed) not in self._started:
                self._started[mode, seed] = start_job(self._model_dir, self._root, f"{mode}-{seed}", mode, seed,
                                                      self._steps.get(mode, STEPS), extra=self._extra)

    def __missing__(self, key: tuple[str, int]) -> dict:
        self.start(key)
        mode, seed = key
        self[key] = fingerprint(finish_job(self._started.pop(key), self._root, f"{mode}-{seed}"))
        return self[key]

    def close(self) -> None:
        for proc in self._started.values():
            proc.kill()
            proc.wait()


def fingerprint(run_dir: pathlib.Path) -> dict:
    """What must be identical across deterministic runs: metrics, trajectories, weights."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("perf/")} for r in rows]
    trajectories = (run_dir / "trajectories.jsonl").read_text().splitlines()
    ckpt = run_dir / "checkpoint"  # a LoRA run checkpoints its adapters only
    weights_file = ckpt / "model.safetensors" if (ckpt / "model.safetensors").exists() else ckpt / "adapter_model.safetensors"
    weights = state_dict_sha256(load_file(str(weights_file)))
    return {"metrics": metrics, "trajectories": trajectories, "weights": weights}


def stop_and_read(proc: subprocess.Popen, out) -> str:
    """Stop the launcher ``proc`` if it still runs (SIGTERM, then wait up to 60 s) and return
    what it wrote to the file ``out``."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out.seek(0)
    return out.read()


TINY_JOB_CONFIG = "configs/quickstart_cpu.yaml"


def tiny_job_overrides(model_dir, steps: int = 2) -> list[str]:
    """Overrides of ``TINY_JOB_CONFIG`` for a job of the tiny model that takes seconds: 2 groups of
    2 samples of 8 tokens a step, no evaluation, no wandb, and no port: every one is chosen at start."""
    return [f"model.path={model_dir}", "model.dtype=float32", "trainer.dtype=float32", "cpu_threads=fixed",
            "inference.threads=1",
            "inference.max_running_requests=8", "rollout.n_samples=2", "rollout.max_new_tokens=8",
            "queue.batch_size=2", f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
            "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0", "eval.max_new_tokens=8",
            "reward.fn=tests.support.parity_reward:even_length", "logging.wandb_mode=disabled"]
