"""One row per run: the numbers of ``summary.csv`` (``COLUMNS`` defines each one). A "mean" is over
the steps holding the metric as a finite number; times are on the run clock of ``runs.py``."""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib

from areal_async.report.runs import RunMetrics

DEFAULT_THRESHOLD = 0.5  # rollout/correct that counts as "reached"
DEFAULT_WINDOW = 5  # steps of the trailing mean of rollout/correct

COLUMNS: dict[str, str] = {
    "cell": "cell name (study) or run directory name",
    "eta": "η = queue.max_staleness",
    "objective": "algo.objective: decoupled (decoupled PPO), naive, tis, mis, icepop, m2po or gspo",
    "interrupt": "on: a weight update interrupts the generations in flight (rollout.interrupt_on_update, the "
                 "default); off: it waits for them (cells named -nointerrupt); blank if unknown",
    "seed": "run seed",
    "state": "study.json state (finished | failed | pending), 'missing' when there are no metrics, blank for a "
             "run directory given alone",
    "steps": "training steps logged (each step once)",
    "last_step": "the last training step logged",
    "resumes": "resume gaps detected and left out of wall_s",
    "elapsed_s": "seconds from the start of the run to its last row, resume gaps included",
    "wall_s": "elapsed_s less the resume gaps: the run clock at the last row",
    "trained_tokens_per_s": "mean over steps of perf/trained_tokens_per_s (a step's train/tokens over its "
                            "train_s: the trainer's rate while it trains)",
    "tokens_per_wall_s": "sum of train/tokens over wall_s (the whole run's rate, waiting, weight sync, "
                         "evaluations and checkpoints included)",
    "step_s": "mean over steps of perf/step_s",
    "reward_last": "mean rollout/reward over the last `window` steps",
    "correct_last": "mean rollout/correct over the last `window` steps",
    "threshold": "the rollout/correct threshold of the next two columns",
    "window": "steps of the trailing mean of rollout/correct",
    "threshold_step": "first step whose trailing mean of rollout/correct over `window` steps (a full window) "
                      "is >= threshold; blank if none",
    "wall_s_to_threshold": "run clock at threshold_step's row; blank if none",
    "eval_first_version": "policy version of the first evaluation row",
    "eval_pass1_first": "eval/pass@1 of the first evaluation",
    "eval_final_version": "policy version of the last evaluation row",
    "eval_pass1_final": "eval/pass@1 of the last evaluation",
    "staleness_mean": "mean over steps of staleness/mean",
    "staleness_max": "max over steps of staleness/max",
    "behav_kl_mean": "mean over steps of train/behav_kl",
    "importance_weight_mean": "mean over steps of train/importance_weight",
    "clip_ratio_mean": "mean over steps of train/clip_ratio",
    "behav_capped_ratio_mean": "mean over steps of train/behav_capped_ratio",
    "multi_version_frac_mean": "mean over steps of rollout/multi_version_frac (blank when not logged)",
    "turns_mean": "mean over steps of rollout/turns (model turns per episode; blank when not logged)",
    "tool_calls_mean": "mean over steps of rollout/tool_calls (per episode; blank when not logged)",
    "tool_errors_mean": "mean over steps of rollout/tool_errors (per episode; blank when not logged)",
    "env_s_mean": "mean over steps of rollout/env_s (seconds in tools per episode; blank when not logged)",
    "prefix_cache_hit_mean": "mean over steps of rollout/prefix_cache_hit (blank when no turn after the first)",
    "truncated_mean": "mean over steps of rollout/truncated (blank when not logged)",
    "run_dir": "the run directory",
}

MEANS = {"trained_tokens_per_s": "perf/trained_tokens_per_s", "step_s": "perf/step_s",
         "staleness_mean": "staleness/mean", "behav_kl_mean": "train/behav_kl",
         "importance_weight_mean": "train/importance_weight", "clip_ratio_mean": "train/clip_ratio",
         "behav_capped_ratio_mean": "train/behav_capped_ratio",
         "multi_version_frac_mean": "rollout/multi_version_frac", "turns_mean": "rollout/turns",
         "tool_calls_mean": "rollout/tool_calls", "tool_errors_mean": "rollout/tool_errors",
         "env_s_mean": "rollout/env_s", "prefix_cache_hit_mean": "rollout/prefix_cache_hit",
         "truncated_mean": "rollout/truncated"}


@dataclasses.dataclass(frozen=True)
class Cell:
    """A run of the report: a study cell or a run directory given alone.

    ``eta``/``objective``/``interrupt``/``seed`` come from ``study.json``, else from the run's
    ``config.yaml`` (``None`` when neither has them); ``interrupt`` is ``"on"`` (a weight update
    interrupts the generations in flight, ``rollout.interrupt_on_update``) or ``"off"``; ``state``
    is the study's cell state, ``""`` for a lone run.
    """

    name: str
    run_dir: pathlib.Path
    eta: int | None
    objective: str | None
    interrupt: str | None
    seed: int | None
    state: str = ""


def mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def trailing_means(values: list[float], window: int) -> list[float | None]:
    """Mean of each value and the ``window - 1`` before it; ``None`` until a full window."""
    return [sum(values[i + 1 - window:i + 1]) / window if i + 1 >= window else None for i in range(len(values))]


def first_crossing(run: RunMetrics, threshold: float, window: int) -> dict | None:
    """The first training row (step order) whose trailing ``window``-step mean of
    ``rollout/correct`` is ``>= threshold``, or ``None``."""
    rows = [r for r in run.train if isinstance(r.get("rollout/correct"), (int, float))]
    for row, m in zip(rows, trailing_means([float(r["rollout/correct"]) for r in rows], window)):
        if m is not None and m >= threshold:
            return row
    return None


def summarize(cell: Cell, run: RunMetrics | None, threshold: float, window: int) -> dict:
    """The ``COLUMNS`` of one run (``None`` for a blank value)."""
    row = dict.fromkeys(COLUMNS)
    row.update(cell=cell.name, eta=cell.eta, objective=cell.objective, interrupt=cell.interrupt, seed=cell.seed,
               threshold=threshold, window=window, state="missing" if run is None else cell.state,
               run_dir=str(cell.run_dir))
    if run is None:
        return row
    row.update(steps=len(run.train), last_step=run.train[-1]["step"] if run.train else None,
               resumes=run.resumes, elapsed_s=run.elapsed_s, wall_s=run.wall_s)
    for column, key in MEANS.items():
        row[column] = mean([v for _, v in run.values(key)])
    tokens = [v for _, v in run.values("train/tokens")]
    row["tokens_per_wall_s"] = sum(tokens) / run.wall_s if tokens and run.wall_s > 0 else None
    row["reward_last"] = mean([v for _, v in run.values("rollout/reward")][-window:])
    row["correct_last"] = mean([v for _, v in run.values("rollout/correct")][-window:])
    hit = first_crossing(run, threshold, window)
    if hit is not None:
        row.update(threshold_step=hit["step"], wall_s_to_threshold=hit["clock_s"])
    evals = [r for r in run.evals if isinstance(r.get("eval/pass@1"), (int, float))]
    if evals:
        row.update(eval_first_version=evals[0]["step"], eval_pass1_first=evals[0]["eval/pass@1"],
                   eval_final_version=evals[-1]["step"], eval_pass1_final=evals[-1]["eval/pass@1"])
    worst = [v for _, v in run.values("staleness/max") if math.isfinite(v)]
    row["staleness_max"] = max(worst) if worst else None
    return row


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """``rows`` (``summarize``) as CSV with a header of ``COLUMNS``; ``None`` is an empty field,
    floats are written in full (``repr``)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
