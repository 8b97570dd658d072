"""One run directory read for a report: its training rows, evaluation rows and run clock.

``read_run`` returns each step once (the last occurrence in ``metrics.jsonl`` wins, training and
evaluation rows apart), in step order, each row with ``clock_s``: seconds since the run's start,
resume downtime left out. ``read_config`` reads a run's ``config.yaml``, ``cell_config`` its grid values.
The rows, the clock and resume gaps: docs/dashboards.md#how-a-run-is-read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import posixpath
import re
import typing

import yaml

from areal_async.config import ModelConfig
from areal_async.model.source import BUILTIN_MODELS

# where runs of one setting differ: their names, directories, logging, where each ran (ports, hosts, devices)
# and whether the job was a resumed one (trainer.resume)
PER_RUN = re.compile(r"^(name|run_root|logging)(\.|$)|(port|host|device|cpus|gpus|node|resume)$")
RESUME_GAP_S = 60.0  # an interval this much longer than its step's perf/step_s is a stop and restart
ELAPSED_SLACK_S = 1.0  # clock differences up to this between two rows of one job are timing noise


class ReportInputError(ValueError):
    """A path given to the report is not a usable run or study directory (message names it and the fix)."""


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """The rows of one run directory, each step once, in step order.

    Attributes:
        run_dir: the run directory.
        train: training rows, ascending ``step``, one per step; each row has ``clock_s`` added.
        evals: evaluation rows, ascending ``step`` (= evaluated version), one per version, with
            ``clock_s`` added.
        resumes: resume gaps detected (docs/dashboards.md#how-a-run-is-read), left out of the clock.
        elapsed_s: seconds from the start (the same page) to the last row, resume gaps included.
        wall_s: the same span on the run clock (resume gaps left out); 0.0 for no rows.
        notes: what was skipped while reading (a truncated last line).
    """

    run_dir: pathlib.Path
    train: list[dict]
    evals: list[dict]
    resumes: int
    elapsed_s: float
    wall_s: float
    notes: list[str]

    def values(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of the training rows that hold ``key`` as a number."""
        return [(r["step"], float(r[key])) for r in self.train if isinstance(r.get(key), (int, float))]


def is_eval_row(row: dict) -> bool:
    """An evaluation row: every key besides ``step`` and ``time`` is an ``eval/*`` key."""
    keys = [k for k in row if k not in ("step", "time")]
    return bool(keys) and all(k.startswith("eval/") for k in keys)


def number(row: dict, key: str) -> float | None:
    """``row[key]`` as a float, ``None`` where it is missing, not a number (``null``) or not finite."""
    value = row.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def metrics_path(run_dir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(run_dir) / "metrics.jsonl"


def read_rows(path: pathlib.Path) -> tuple[list[dict], list[str]]:
    """The rows of a ``metrics.jsonl`` in file order, and notes on what was skipped.

    Raises:
        ReportInputError: a line other than the last is not a JSON object with ``step`` and ``time``.
    """
    lines = path.read_text().splitlines()
    rows, notes = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int) \
                    or not isinstance(row.get("time"), (int, float)):
                raise ValueError("not an object with an integer 'step' and a number 'time'")
        except ValueError as exc:
            if i == len(lines) - 1:
                notes.append(f"{path}: the last line ({i + 1}) is incomplete and was skipped (a job stopped "
                             f"while writing it)")
                continue
            raise ReportInputError(f"{path}, line {i + 1}: {exc}; each line must be one metrics row as "
                                   f"areal_async/metrics.py writes it (remove or repair that line)") from None
        rows.append(row)
    return rows, notes


def read_run(run_dir: pathlib.Path, resume_gap_s: float = RESUME_GAP_S) -> RunMetrics:
    """Read ``run_dir/metrics.jsonl`` (last occurrence wins, run clock, resume gaps: docs/dashboards.md#how-a-run-is-read).

    Raises:
        ReportInputError: no ``metrics.jsonl``, or it holds no row (nothing logged yet), or a bad line.
    """
    run_dir = pathlib.Path(run_dir)
    path = metrics_path(run_dir)
    if not path.is_file():
        raise ReportInputError(f"{path} does not exist: {run_dir} has no metrics yet (a job writes a row at the "
                               f"end of each step); run or resume the job (python -m launcher.local ...), or leave "
                               f"{run_dir} out")
    rows, notes = read_rows(path)
    if not rows:
        raise ReportInputError(f"{path} is empty: no step of {run_dir} was logged; run or resume the job "
                               f"(python -m launcher.local ...), or leave {run_dir} out")
    train: dict[int, tuple[int, dict]] = {}  # step → (file position, row): the last occurrence wins
    evals: dict[int, tuple[int, dict]] = {}
    for pos, row in enumerate(rows):
        (evals if is_eval_row(row) else train)[row["step"]] = (pos, row)
    steps = sorted(train)

    # a training row whose step is not past the one before it in the file was written by a later job
    training = [(pos, row["step"]) for pos, row in enumerate(rows) if not is_eval_row(row)]
    later_job = {pos for (pos, step), (_, before) in zip(training[1:], training) if step <= before}
    gaps: list[tuple[float, float]] = []  # resume gaps: (time they start at, seconds left out)
    for prev, k in zip(steps, steps[1:]):
        (p0, r0), (p1, r1) = train[prev], train[k]
        certain = any(p0 < q <= p1 for q in later_job)
        if number(r0, "perf/elapsed_s") is not None and number(r1, "perf/elapsed_s") is not None:
            excess = r1["time"] - r0["time"] - (number(r1, "perf/elapsed_s") - number(r0, "perf/elapsed_s"))
            found = excess > ELAPSED_SLACK_S
        else:
            excess = r1["time"] - r0["time"] - (number(r1, "perf/step_s") or 0.0)
            found = excess > resume_gap_s
        if excess > 0 and (certain or found):
            gaps.append((r0["time"], excess))

    first = train[steps[0]][1] if steps else None
    start = min([r["time"] for r in rows] + ([first["time"] - (number(first, "perf/step_s") or 0.0)] if first else []))

    def clock(t: float) -> float:
        # a row inside a gap (e.g. a resumed job's first evaluation) is placed at the gap's start
        return t - start - sum(min(max(t - at, 0.0), excess) for at, excess in gaps)

    end = max(r["time"] for r in rows)
    out_train = [{**train[k][1], "clock_s": clock(train[k][1]["time"])} for k in steps]
    out_evals = [{**evals[v][1], "clock_s": clock(evals[v][1]["time"])} for v in sorted(evals)]
    return RunMetrics(run_dir, out_train, out_evals, len(gaps), end - start, clock(end), notes)


def dotted(cfg: dict, key: str):
    """The value of dotted ``key`` in a config dict, ``None`` where a part is missing."""
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def read_config(run_dir: pathlib.Path) -> dict | None:
    """``run_dir/config.yaml`` as a dict; ``None`` where it is missing, unreadable or not a mapping."""
    try:
        cfg = yaml.safe_load((pathlib.Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return cfg if isinstance(cfg, dict) else {} if cfg is None else None


def cell_config(cfg: dict | None, group_by: list[str] = ()) -> dict:
    """``eta``, ``objective``, ``interrupt``, ``seed`` of a run's config (``read_config``), and
    ``grid``: ``{key: value}`` of each dotted key of ``group_by`` (``None`` where missing).

    ``queue.max_staleness``; ``algo.objective`` (a run written before it replaced the boolean
    ``algo.decoupled``: true → ``"decoupled"``, false → ``"naive"``);
    ``rollout.interrupt_on_update`` → ``"on"``/``"off"`` (a config without the key, written before
    the switch existed, → ``"on"``, its default and the only behaviour then); ``seed``. No config
    (``None``) gives ``None`` for all four, a missing key (or a non-boolean switch) ``None`` for
    its value.
    """
    if cfg is None:
        return {**dict.fromkeys(("eta", "objective", "interrupt", "seed")), "grid": dict.fromkeys(group_by)}
    algo = cfg.get("algo") or {}
    objective = algo.get("objective", {True: "decoupled", False: "naive"}.get(algo.get("decoupled")))
    interrupt = (cfg.get("rollout") or {}).get("interrupt_on_update", True)
    return {"eta": (cfg.get("queue") or {}).get("max_staleness"),
            "objective": objective,
            "interrupt": {True: "on", False: "off"}.get(interrupt) if isinstance(interrupt, bool) else None,
            "seed": cfg.get("seed"), "grid": {key: dotted(cfg, key) for key in group_by}}


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def builtin_model(cfg: dict) -> str | None:
    """The built-in model (a name of ``BUILTIN_MODELS``) a run's config trains, ``None`` for any
    other: ``model.path`` is its name, or ``<model.cache_dir>/<name>``, where the launcher puts it;
    a ``~`` or relative ``model.cache_dir`` matches under any directory (the home or working
    directory of the machine the run was on). A directory of that name elsewhere is not one."""
    path, cache = dotted(cfg, "model.path"), dotted(cfg, "model.cache_dir")
    if not isinstance(path, str):
        return None
    if path in BUILTIN_MODELS:
        return path
    where = pathlib.PurePosixPath(posixpath.normpath(path))
    if where.name not in BUILTIN_MODELS:
        return None
    cache = pathlib.PurePosixPath(posixpath.normpath(cache if isinstance(cache, str) else ModelConfig().cache_dir))
    parts = cache.parts[1:] if cache.parts and cache.parts[0].startswith("~") else cache.parts
    under = where.parent.parts
    if cache.is_absolute():
        return where.name if under == parts else None
    return where.name if not parts or under[-len(parts):] == parts else None


def config_differences(a: dict | None, b: dict | None, same: typing.Collection[str] = ()) -> list[str]:
    """The dotted keys whose values differ in configs ``a`` and ``b`` of two runs (``read_config``),
    a key that one holds and the other lacks included; ``[]`` where either is ``None``. Left out:
    ``PER_RUN`` keys, those of ``same`` (compared otherwise), and ``model.path`` and
    ``model.cache_dir`` where both runs train the same built-in model (``builtin_model``): then
    they are only where it lies on each machine."""
    if a is None or b is None:
        return []
    ca, cb = _flat(a), _flat(b)
    model = builtin_model(a)
    if model is not None and model == builtin_model(b):
        same = {*same, "model.path", "model.cache_dir"}
    keys = [*ca, *(k for k in cb if k not in ca)]
    return [k for k in keys if not PER_RUN.search(k) and k not in same
            and (k not in ca or k not in cb or ca[k] != cb[k])]


def lacks(cfg: dict, key: str) -> bool:
    """Whether a run's config holds no dotted ``key`` (a key absent, not one set to null)."""
    return key not in _flat(cfg)
