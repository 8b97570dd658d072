"""One row per run: the numbers of ``summary.csv`` (``COLUMNS`` defines each one, and each ``--grid``
key of a study is a column of its own, after ``interrupt``). A "mean" is over the steps holding the
metric as a finite number; times are on the run clock of ``runs.py``.

Two numbers compare runs: ``speedup_vs_sync`` (``add_speedups``) and the time to a threshold
(``Threshold``, ``first_crossing``) of a rollout metric.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib

from areal_async.report.runs import RunMetrics

DEFAULT_METRIC = "rollout/correct"  # the metric of the time to threshold
DEFAULT_THRESHOLD = 0.5  # its value that counts as "reached"
DEFAULT_WINDOW = 5  # steps of its trailing mean
START = "start+"  # a threshold "start+0.1": 0.1 above the run's start

COLUMNS: dict[str, str] = {
    "cell": "cell name (study) or run directory name",
    "eta": "η = queue.max_staleness",
    "objective": "algo.objective: decoupled (decoupled PPO), naive, tis, mis, icepop, m2po or gspo",
    "interrupt": "on: a weight update interrupts the generations in flight (rollout.interrupt_on_update, the "
                 "default); off: it waits for them (cells named -nointerrupt); blank if unknown",
    # here, in the order of the study's --grid flags: one column per --grid key (GRID_COLUMN)
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
    "speedup_vs_sync": "step_s of the η = 0 run with this run's objective, interrupt, --grid values and seed, "
                       "divided by this run's step_s (> 1: faster than synchronous RL; 1 at η = 0; blank without "
                       "that run or its step_s)",
    "reward_last": "mean rollout/reward over the last `window` steps",
    "correct_last": "mean rollout/correct over the last `window` steps",
    "no_eos_last": "mean rollout/no_eos_ratio over the last `window` steps: the share of samples cut at "
                   "max_new_tokens without an end of sequence (the truncation rate; 1 - it: the completion rate)",
    "response_len_last": "mean rollout/response_len over the last `window` steps (tokens)",
    "threshold_metric": "the metric of the time to threshold (--metric, default rollout/correct)",
    "threshold": "the threshold as given: a value (--threshold 0.5) or 'start+D' (D above the run's start: the "
                 "metric's mean over its first `window` steps)",
    "window": "steps of the trailing mean of threshold_metric",
    "threshold_value": "this run's threshold: the value, or its start + D; blank if the run has fewer than "
                       "`window` steps of the metric",
    "threshold_reached": "True when some full-window trailing mean of threshold_metric is >= threshold_value, "
                         "False when none is ('not reached' in report.html); blank when threshold_value is",
    "threshold_step": "first step whose trailing mean of threshold_metric over `window` steps (a full window) "
                      "is >= threshold_value; blank if not reached",
    "wall_s_to_threshold": "run clock at threshold_step's row; blank if not reached",
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


GRID_COLUMN = "varied by the study (--grid): this run's value of the config key"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A run of the report: a study cell or a run directory given alone.

    ``eta``/``objective``/``interrupt``/``seed`` come from ``study.json``, else from the run's
    ``config.yaml`` (``None`` when neither has them); ``interrupt`` is ``"on"`` (a weight update
    interrupts the generations in flight, ``rollout.interrupt_on_update``) or ``"off"``; ``grid``
    is the run's value of each varied config key (a study's ``--grid``, or the report's
    ``--group-by`` for run directories), ``{dotted key: value}``; ``state`` is the study's cell
    state, ``""`` for a lone run.
    """

    name: str
    run_dir: pathlib.Path
    eta: int | None
    objective: str | None
    interrupt: str | None
    seed: int | None
    state: str = ""
    grid: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """The time to threshold's definition: ``metric`` (a training-row key, e.g. ``rollout/correct``)
    reaches ``value``, or with ``relative`` the run's start plus ``value``, in a trailing mean over
    ``window`` steps."""

    metric: str = DEFAULT_METRIC
    value: float = DEFAULT_THRESHOLD
    relative: bool = False
    window: int = DEFAULT_WINDOW
    given: str = dataclasses.field(default="", compare=False)  # the text parsed, e.g. "0.50"

    @classmethod
    def parse(cls, text, metric: str = DEFAULT_METRIC, window: int = DEFAULT_WINDOW) -> Threshold:
        """``0.5`` / ``"0.5"`` (a value) or ``"start+0.1"`` (0.1 above the start). Raises ``ValueError``
        naming the text and the fix: not a number, ``start+`` with a value <= 0, ``window`` < 1, a
        value of ``rollout/correct`` (a fraction) outside [0, 1]."""
        spec = str(text).strip()
        relative = spec.startswith(START)
        try:
            value = float(spec[len(START):] if relative else spec)
        except ValueError:
            raise ValueError(f"threshold {spec} is not a number; give a value of {metric} (--threshold 0.5) or "
                             f"one above the run's start (--threshold {START}0.1)") from None
        if window < 1:
            raise ValueError(f"window {window}: the trailing mean needs at least 1 step; give --window 1 or more")
        if relative and not value > 0:
            raise ValueError(f"threshold {spec}: a threshold above the start needs a rise > 0, e.g. {START}0.1")
        if metric == "rollout/correct" and not relative and not 0.0 <= value <= 1.0:
            raise ValueError(f"threshold {spec}: rollout/correct is a fraction; give a threshold in [0, 1], "
                             f"e.g. --threshold 0.5")
        return cls(metric, value, relative, window, spec)

    def text(self) -> str:
        """``"0.50"`` or ``"start+0.1"``: the text as given (else as it would be given)."""
        return self.given or f"{START if self.relative else ''}{self.value:.10g}"


def mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def trailing_means(values: list[float], window: int) -> list[float | None]:
    """Mean of each value and the ``window - 1`` before it; ``None`` until a full window."""
    return [sum(values[i + 1 - window:i + 1]) / window if i + 1 >= window else None for i in range(len(values))]


def first_crossing(run: RunMetrics, threshold: Threshold) -> tuple[float | None, dict | None]:
    """``(target, row)``: the run's threshold value (``None`` with fewer than ``window`` steps of
    the metric) and the first training row (step order) whose trailing ``window``-step mean of the
    metric is ``>= target`` (``None`` if none). With ``relative``, target = the first full
    window's mean + ``value``."""
    rows = [r for r in run.train if isinstance(r.get(threshold.metric), (int, float))]
    means = trailing_means([float(r[threshold.metric]) for r in rows], threshold.window)
    full = [(row, m) for row, m in zip(rows, means) if m is not None]
    if not full:
        return None, None
    target = full[0][1] + threshold.value if threshold.relative else threshold.value
    return target, next((row for row, m in full if m >= target), None)


def columns(grid_keys: list[str]) -> dict[str, str]:
    """``COLUMNS`` with a column per ``--grid`` key after ``interrupt``."""
    names = list(COLUMNS)
    at = names.index("interrupt") + 1
    return {c: COLUMNS.get(c, GRID_COLUMN) for c in names[:at] + list(grid_keys) + names[at:]}


def add_speedups(rows: list[dict]) -> None:
    """Set each row's ``speedup_vs_sync`` (``COLUMNS``) in place: the ``step_s`` of the η = 0 row
    with the same objective, interrupt, grid values (``row["grid"]``) and seed over its own."""
    def twin(row: dict) -> tuple:
        return row["objective"], row["interrupt"], repr(sorted(row["grid"].items())), row["seed"]

    sync = {twin(r): r["step_s"] for r in rows if r["eta"] == 0 and r["step_s"]}
    for row in rows:
        base = sync.get(twin(row)) if row["eta"] is not None else None
        row["speedup_vs_sync"] = base / row["step_s"] if base and row["step_s"] else None


POINT_MEANS = ("step_s", "speedup_vs_sync", "correct_last", "reward_last", "no_eos_last", "eval_pass1_final",
               "threshold_step", "wall_s_to_threshold")


def by_grid_point(rows: list[dict], grid_keys: list[str]) -> list[dict]:
    """One row per grid point (η, objective, interrupt, ``--grid`` values) of the ``summarize``
    rows that have metrics and a known η and objective, in order of first appearance: ``eta``,
    ``objective``, ``interrupt``, each grid key, ``seeds`` (its runs), the mean over its runs of
    each ``POINT_MEANS`` column (over the runs holding a value; ``threshold_step`` and
    ``wall_s_to_threshold`` so over those that reached the threshold), and ``reached``:
    ``"k/n"``, runs that reached it of those with a threshold value."""
    points: dict[str, list[dict]] = {}
    for r in rows:
        if r["state"] != "missing" and r["eta"] is not None and r["objective"] is not None:
            key = json.dumps([r["eta"], r["objective"], r["interrupt"], [r.get(k) for k in grid_keys]])
            points.setdefault(key, []).append(r)
    out = []
    for runs in points.values():
        first = runs[0]
        row = {"eta": first["eta"], "objective": first["objective"], "interrupt": first["interrupt"],
               **{k: first.get(k) for k in grid_keys}, "seeds": len(runs)}
        row.update({c: mean([r[c] for r in runs if r[c] is not None]) for c in POINT_MEANS})
        tried = [r for r in runs if r["threshold_reached"] is not None]
        row["reached"] = f"{sum(r['threshold_reached'] for r in tried)}/{len(tried)}" if tried else None
        out.append(row)
    return out


def summarize(cell: Cell, run: RunMetrics | None, threshold: Threshold) -> dict:
    """The ``COLUMNS`` of one run (``None`` for a blank value), its ``--grid`` values as columns too
    and as ``grid`` (a dict); ``speedup_vs_sync`` is set across the rows by ``add_speedups``."""
    window = threshold.window
    row = dict.fromkeys(COLUMNS)
    row.update(cell=cell.name, eta=cell.eta, objective=cell.objective, interrupt=cell.interrupt, seed=cell.seed,
               threshold_metric=threshold.metric, threshold=threshold.text(), window=window,
               state="missing" if run is None else cell.state, run_dir=str(cell.run_dir), grid=dict(cell.grid),
               **cell.grid)
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
    row["no_eos_last"] = mean([v for _, v in run.values("rollout/no_eos_ratio")][-window:])
    row["response_len_last"] = mean([v for _, v in run.values("rollout/response_len")][-window:])
    target, hit = first_crossing(run, threshold)
    row.update(threshold_value=target, threshold_reached=None if target is None else hit is not None)
    if hit is not None:
        row.update(threshold_step=hit["step"], wall_s_to_threshold=hit["clock_s"])
    evals = [r for r in run.evals if isinstance(r.get("eval/pass@1"), (int, float))]
    if evals:
        row.update(eval_first_version=evals[0]["step"], eval_pass1_first=evals[0]["eval/pass@1"],
                   eval_final_version=evals[-1]["step"], eval_pass1_final=evals[-1]["eval/pass@1"])
    worst = [v for _, v in run.values("staleness/max") if math.isfinite(v)]
    row["staleness_max"] = max(worst) if worst else None
    return row


def write_csv(path: pathlib.Path, rows: list[dict], grid_keys: list[str] = ()) -> None:
    """``rows`` (``summarize``) as CSV with a header of ``columns(grid_keys)``; ``None`` is an empty
    field, floats are written in full (``repr``), a list value as JSON."""
    names = list(columns(list(grid_keys)))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else json.dumps(row[k]) if isinstance(row[k], list)
                             else row[k] for k in names})
