"""Per-step metrics: ``metrics.jsonl``, a wandb run (offline by default) and one console line.

Metric names follow docs/design.md (``rollout/*``, ``staleness/*``, ``queue/*``, ``train/*``,
``perf/*``, ``version/*``, ``eval/*``). Values are floats, except ``*/hist`` entries, which are
lists of raw values: they go to ``metrics.jsonl`` as lists and to wandb as histograms. wandb's
directories (``WANDB_DIR``, cache, data, config) live under the run directory; runs are grouped by
``logging.wandb_group`` (default: the experiment name) and tagged with ``logging.wandb_tags``, so the
cells of a staleness study (``launcher.ablation``) overlay in one dashboard.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import secrets
import sys
import time

from areal_async.config import LoggingConfig


def _wandb_env(run_dir: pathlib.Path) -> None:
    base = run_dir / "wandb"
    for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_CONFIG_DIR", "config")):
        path = base / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
    os.environ.setdefault("WANDB_SILENT", "true")


def format_line(step: int, total_steps: int, m: dict) -> str:
    """The one-line console summary of a step (missing metrics are left out).

    ``rollout N tok/step-s`` is ``rollout/tokens_per_s``: the batch's output tokens over the step's
    wall time, the rate at which generation fed training, not the servers' decoding speed (which
    they do not report; with η ≥ 1 they also generate the next batches meanwhile).
    """
    parts = [f"step {step:>4}/{total_steps}"]
    fmt = [
        ("rollout/reward", "reward {:+.2f}"),
        ("rollout/correct", "correct {:.2f}"),
        ("staleness/mean", "staleness {:.2f}"),
        ("rollout/response_len", "len {:.0f}"),
        ("train/loss", "loss {:+.4f}"),
        ("train/entropy", "entropy {:.3f}"),
        ("train/lr", "lr {:.2e}"),
        ("perf/trained_tokens_per_s", "train {:.0f} tok/s"),
        ("rollout/tokens_per_s", "rollout {:.0f} tok/step-s"),
        ("perf/step_s", "{:.1f} s"),
        ("eval/pass@1", "eval pass@1 {:.3f}"),
    ]
    for key, spec in fmt:
        value = m.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(spec.format(value))
    return " | ".join(parts)


class MetricsLogger:
    """Writes one record per step. Construct on trainer rank 0 only.

    Args:
        run_dir: the run directory (``runs/<name>``); created if missing.
        cfg: the logging sub-config.
        name: experiment name (wandb run name; the group when ``cfg.wandb_group`` is empty).
        config: the resolved root config as a plain dict (given to wandb).
        total_steps: for the console progress line.
    """

    def __init__(self, run_dir, cfg: LoggingConfig, name: str, config: dict, total_steps: int = 0):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.total_steps = total_steps
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._wandb = None
        if cfg.wandb_mode != "disabled":
            _wandb_env(self.run_dir)
            import wandb

            # one wandb run per run directory: a resumed job continues it (same id) instead of
            # starting a second run on the dashboard
            id_file = self.run_dir / "wandb_run_id"
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(8))
            self._wandb = wandb.init(
                project=cfg.wandb_project, group=cfg.wandb_group or name, name=name, tags=cfg.wandb_tags,
                config=config, id=id_file.read_text().strip(),
                resume="allow", mode=cfg.wandb_mode, dir=os.environ["WANDB_DIR"], reinit="finish_previous",
            )

    def log(self, step: int, metrics: dict) -> None:
        """Record ``metrics`` for ``step``: a JSON line, a wandb row and a console line."""
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            import wandb

            row = {k: (wandb.Histogram(v) if k.endswith("/hist") else v) for k, v in metrics.items()
                   if not (k.endswith("/hist") and not v)}
            self._wandb.log(row, step=step)
        if self.cfg.log_every and step % self.cfg.log_every == 0:
            print(format_line(step, self.total_steps, metrics), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
