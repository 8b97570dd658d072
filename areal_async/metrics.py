"""Per-step metrics: ``metrics.jsonl``, a wandb run (offline by default) and one console line.

Values are floats, except ``*/hist``: lists (histograms in wandb). Names: docs/metrics.md. A resumed
job logs to a new wandb run ``<name>-r<n>`` starting at the checkpoint's step, so its rows are
``metrics.jsonl``'s from there on (``RUN_DIR/wandb_runs.jsonl`` lists them; docs/dashboards.md#resumed-runs).
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


RUNS_FILE = "wandb_runs.jsonl"  # in the run directory: one line per job's wandb run


def _earlier_runs(run_dir: pathlib.Path, name: str) -> list[dict]:
    """The wandb runs of the run directory's earlier jobs, oldest first (``RUNS_FILE``; a run
    directory written before it existed holds one id in ``wandb_run_id``)."""
    path, legacy = run_dir / RUNS_FILE, run_dir / "wandb_run_id"
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    if legacy.exists():
        return [{"id": legacy.read_text().strip(), "name": name, "start_step": 0}]
    return []


def _rows_from(path: pathlib.Path, step: int) -> list[dict]:
    """The rows of the metrics log ``path`` at steps >= ``step``, without ``time`` ([] if missing)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [{k: v for k, v in row.items() if k != "time"} for row in rows if row["step"] >= step]


def _wandb_row(metrics: dict) -> dict:
    """``metrics`` as a wandb row: ``*/hist`` lists become histograms (empty ones are left out);
    a ``step`` key is dropped (it is the row's wandb step)."""
    import wandb

    return {k: (wandb.Histogram(v) if k.endswith("/hist") else v) for k, v in metrics.items()
            if k != "step" and not (k.endswith("/hist") and not v)}


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
        resumed_at: ``None`` for a fresh run; for a resumed job, the checkpoint's step k (the first
            step it logs), after ``drop_superseded_rows`` has cut ``metrics.jsonl`` at k. It starts
            a new wandb run (docs/dashboards.md#resumed-runs) and gives it the rows ``metrics.jsonl`` kept at
            steps >= k.
    """

    def __init__(self, run_dir, cfg: LoggingConfig, name: str, config: dict, total_steps: int = 0,
                 resumed_at: int | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.total_steps = total_steps
        self._wandb = None
        if cfg.wandb_mode != "disabled":
            _wandb_env(self.run_dir)
            import wandb

            runs = _earlier_runs(self.run_dir, name) if resumed_at is not None else []
            run_name, run_config = name, config
            if resumed_at is not None:
                run_name = f"{name}-r{max(len(runs), 1)}"
                run_config = {**config, "resumed_from": {"step": resumed_at, "runs": [r["id"] for r in runs]}}
            run_id = secrets.token_hex(8)
            self._wandb = wandb.init(
                project=cfg.wandb_project, group=cfg.wandb_group or name, name=run_name, tags=cfg.wandb_tags,
                config=run_config, id=run_id, mode=cfg.wandb_mode, dir=os.environ["WANDB_DIR"],
                reinit="finish_previous",
            )
            runs.append({"id": run_id, "name": run_name, "start_step": resumed_at or 0})
            (self.run_dir / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in runs))
            if resumed_at is not None:
                for row in _rows_from(self.run_dir / "metrics.jsonl", resumed_at):
                    self._wandb.log(_wandb_row(row), step=row["step"])
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        """Record ``metrics`` for ``step``: a JSON line, a wandb row and a console line."""
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(_wandb_row(metrics), step=step)
        if self.cfg.log_every and step % self.cfg.log_every == 0:
            print(format_line(step, self.total_steps, metrics), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
