"""Run directories for the report's tests: a ``config.yaml`` and synthetic ``metrics.jsonl`` rows."""

from __future__ import annotations

import json


def write_run(run_dir, rows, eta=1, decoupled=True, seed=1, interrupt=None):
    """``interrupt``: ``rollout.interrupt_on_update`` written as true/false, or left out (``None``)."""
    run_dir.mkdir(parents=True)
    rollout = "" if interrupt is None else f"rollout:\n  interrupt_on_update: {'true' if interrupt else 'false'}\n"
    (run_dir / "config.yaml").write_text(f"seed: {seed}\nqueue:\n  max_staleness: {eta}\nalgo:\n  objective: "
                                         f"{'decoupled' if decoupled else 'naive'}\n{rollout}")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def train_row(step, time, correct, stale_mean, stale_max, tok_s, **extra):
    return {"step": step, "time": time, "train/loss": 0.1, "rollout/reward": 10 * correct - 5,
            "rollout/correct": correct, "staleness/mean": stale_mean, "staleness/max": stale_max,
            "staleness/hist": [0.0, stale_max], "perf/step_s": 2.0, "perf/trained_tokens_per_s": tok_s,
            "train/tokens": 100.0, "train/importance_weight": 1.0, "train/clip_ratio": 0.0, **extra}


def timed(step_s):
    """Two steps whose perf/step_s are ``step_s`` (clock 2 s apart)."""
    return [train_row(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 10.0, **{"perf/step_s": s}) for k, s in enumerate(step_s)]
