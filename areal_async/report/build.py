"""The report of a staleness study or of any runs: ``summary.csv`` and a self-contained ``report.html``.

    python tools/report.py runs/<study>                       # a study: written into runs/<study>/
    python tools/report.py RUN_DIR [RUN_DIR ...] [--out DIR]   # any runs (one run: into RUN_DIR)
        [--group-by KEY ...] [--metric KEY] [--threshold X | start+D] [--window N] [--resume-gap-s S]

Figures are embedded as PNG data URIs; bad input raises ``ReportInputError`` (exit status 2).
What it reads and shows: docs/dashboards.md#the-studys-report.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import json
import math
import pathlib
import re
import sys

import jinja2
import markupsafe

from areal_async.config_hints import RENAMED
from areal_async.report import plots
from areal_async.report.runs import (RESUME_GAP_S, ReportInputError, RunMetrics, cell_config, config_differences,
                                     lacks, read_config, read_run)
from areal_async.report.summary import (DEFAULT_METRIC, DEFAULT_THRESHOLD, DEFAULT_WINDOW, POINT_MEANS, Cell,
                                        Threshold, add_speedups, by_grid_point, columns, summarize, write_csv)

# constant, long or said otherwise: stated above the table, or "not reached" in the threshold columns
HTML_HIDDEN = ("threshold_metric", "threshold", "window", "threshold_reached", "run_dir")
NOT_REACHED = ("threshold_step", "wall_s_to_threshold")
# config keys every run's row has already, as these columns: not a --group-by key
OWN_KEYS = {"queue.max_staleness": "eta", "algo.objective": "objective", "rollout.interrupt_on_update": "interrupt",
            "seed": "seed"}
POINT_COLUMNS = {"seeds": "runs of the grid point with metrics (its seeds)",
                 "reached": "runs that reached the threshold, of those with enough steps for its window"}


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    csv: pathlib.Path
    html: pathlib.Path
    rows: list[dict]  # summarize() rows, one per cell, in the cells' order


def is_study_dir(path: pathlib.Path) -> bool:
    return (path / "study.json").is_file()


def is_run_dir(path: pathlib.Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "config.yaml").is_file()


def study_cells(root: pathlib.Path) -> tuple[dict, list[Cell]]:
    """``study.json`` of ``root`` and its cells, in run order.

    Raises:
        ReportInputError: ``study.json`` is not valid JSON with a ``cells`` list.
    """
    path = root / "study.json"
    try:
        study = json.loads(path.read_text())
        # a study.json written before the interruption axis has no "interrupts": all its cells ran with it on
        default = "on" if "interrupts" not in study else None
        cells = [Cell(c["name"], root / c["name"], eta=c.get("eta"), objective=c.get("objective"),
                      interrupt=c.get("interrupt", default), seed=c.get("seed"), state=c.get("state") or "",
                      grid=dict(c.get("grid") or {})) for c in study["cells"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ReportInputError(f"{path} is not a study record ({exc!r}); it is written by python -m "
                               f"launcher.ablation: run the study again to rewrite it") from None
    return study, cells


def run_cell(run_dir: pathlib.Path, group_by: list[str] = (), config: dict | None = None) -> Cell:
    """The cell of a run directory given alone; ``config``: its ``config.yaml`` if read already
    (``runs.read_config``), else it is read here."""
    cfg = cell_config(config if config is not None else read_config(run_dir), group_by)
    return Cell(run_dir.name or str(run_dir), run_dir, eta=cfg["eta"], objective=cfg["objective"],
                interrupt=cfg["interrupt"], seed=cfg["seed"], grid=cfg["grid"])


def compact(value) -> str:
    """A table cell's text: blank for ``None``, floats to 3 significant digits (thousands grouped
    from 1000 on, no exponent there), lists as JSON."""
    if value is None:
        return ""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def header_html(name: str) -> markupsafe.Markup:
    """A column name that may wrap after ``_``, ``.`` and ``/`` (``<wbr>``), escaped."""
    return markupsafe.Markup("").join(
        markupsafe.escape(part) + (markupsafe.Markup("<wbr>") if part and part[-1] in "_./" else "")
        for part in re.split(r"(?<=[_./])", name))


def table_cells(row: dict, shown: list[str]) -> list[dict]:
    """The HTML table's cells of a ``summarize`` row: text, and whether it is left-aligned text."""
    cells = []
    for c in shown:
        value = "not reached" if c in NOT_REACHED and row["threshold_reached"] is False else compact(row[c])
        cells.append({"value": value, "text": isinstance(row[c], str) or value == "not reached"})
    return cells


def point_table(rows: list[dict], grid_keys: list[str]) -> dict | None:
    """The HTML table of ``by_grid_point`` (means over seeds); ``None`` when every point has one run."""
    points = by_grid_point(rows, grid_keys)
    if all(p["seeds"] <= 1 for p in points):
        return None
    described = columns(grid_keys)
    keys = ["eta", "objective", *(["interrupt"] if len({p["interrupt"] for p in points}) > 1 else []), *grid_keys]
    names = [*keys, "seeds", *POINT_MEANS[:-2], "reached", *POINT_MEANS[-2:]]  # "reached" before the time to it
    about = {**described, **POINT_COLUMNS}
    return {"columns": [{"header": header_html(c), "description": about[c] + (" (mean over the grid point's runs)" if
                                                                               c in POINT_MEANS else "")}
                        for c in names],
            "rows": [[{"value": "not reached", "text": True} if c in NOT_REACHED and none_reached(p)
                      else {"value": compact(p[c]), "text": isinstance(p[c], str)} for c in names] for p in points]}


def none_reached(point: dict) -> bool:
    """No run of a ``by_grid_point`` row reached the threshold (of at least one that could)."""
    return (point["reached"] or "").startswith("0/")


def render_html(title: str, about: str, study: dict | None, rows: list[dict], missing: list[dict],
                notes: list[str], panels: list[plots.Panel], threshold: Threshold, grid_keys: list[str]) -> str:
    """``report.html.j2`` rendered (autoescaped): the table of ``rows`` and the panels as data URIs.

    The table scrolls inside its own box (the page never overflows sideways), its first column (the
    cell's name, which holds every varied key) stays in view, headers wrap at ``_``/``.``; a column
    blank in every row is left out."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(pathlib.Path(__file__).parent), autoescape=True)
    described = columns(grid_keys)
    # a column blank in every row is left out (summary.csv keeps it); the keys stay
    keys = ("cell", "eta", "objective", "interrupt", *grid_keys, "seed", "state")
    shown = [c for c in described if c not in HTML_HIDDEN and (c in keys or any(r.get(c) is not None for r in rows))]
    table = [{"missing": r["state"] == "missing", "cells": table_cells(r, shown)} for r in rows]
    return env.get_template("report.html.j2").render(
        title=title, about=about, study=study, missing=missing, notes=notes, threshold=threshold,
        grid=" × ".join(f"{a['key']} {json.dumps(a['values'])}" for a in (study or {}).get("grid", [])),
        columns=[{"name": c, "header": header_html(c), "description": described[c]} for c in shown], rows=table,
        points=point_table(rows, grid_keys),
        panels=[{"title": p.title, "caption": p.caption, "b64": base64.b64encode(p.png).decode("ascii")}
                for p in panels])


def write_report(cells: list[Cell], out: pathlib.Path, *, title: str, study: dict | None = None,
                 threshold: float | str = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW,
                 metric: str = DEFAULT_METRIC, resume_gap_s: float = RESUME_GAP_S, strict: bool = False) -> ReportFiles:
    """Write ``out/summary.csv`` and ``out/report.html`` for ``cells``.

    Args:
        cells: the runs, in the table's order; their ``grid`` keys are the table's grid columns.
        out: output directory (created if missing).
        study: ``study.json``'s record, shown in the report's header.
        threshold, window, metric: the time to threshold (``summary.Threshold.parse``): ``metric``
            reaches ``threshold`` (a value, or ``"start+D"``) in a trailing mean over ``window`` steps.
        resume_gap_s: see ``runs.py``.
        strict: a cell without metrics raises instead of being listed as missing.

    Raises:
        ReportInputError: a bad threshold or window; with ``strict``, a cell without metrics.
    """
    try:
        rule = Threshold.parse(threshold, metric, window)
    except ValueError as exc:
        raise ReportInputError(str(exc)) from None
    grid_keys = list(dict.fromkeys(k for cell in cells for k in cell.grid))
    read: list[tuple[Cell, RunMetrics]] = []
    rows, missing, notes = [], [], []
    for cell in cells:
        try:
            run = read_run(cell.run_dir, resume_gap_s)
        except ReportInputError as exc:
            if strict:
                raise
            run = None
            missing.append({"name": cell.name, "state": cell.state, "reason": str(exc)})
        if run is not None:
            read.append((cell, run))
            notes += run.notes
        rows.append(summarize(cell, run, rule))
    add_speedups(rows)
    if read and not any(rule.metric in r for _, run in read for r in run.train):
        notes.append(f"no run logs {rule.metric}, so the time to threshold is blank: give --metric a key of "
                     f"metrics.jsonl's training rows, e.g. {DEFAULT_METRIC}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", rows, grid_keys)
    groups = plots.groups_of(read)
    panels = [p for p in (plots.learning_curves(groups, "step", rule), plots.learning_curves(groups, "wall", rule),
                          plots.eval_curves(groups), plots.throughput(rows), plots.time_to_threshold(rows, rule),
                          plots.interruption(rows),
                          plots.staleness_histograms(groups), plots.diagnostics(groups),
                          plots.episodes(groups)) if p is not None]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    about = (f"{len(cells)} run(s), {len(missing)} without metrics; written {when} from each run's "
             f"metrics.jsonl (each step once, the last occurrence wins).")
    (out / "report.html").write_text(render_html(title, about, study, rows, missing, notes, panels, rule,
                                                 grid_keys))
    return ReportFiles(out / "summary.csv", out / "report.html", rows)


def write_study_report(root: pathlib.Path, out: pathlib.Path | None = None, **kwargs) -> ReportFiles:
    """The report of the study in ``root`` (``study.json``), written into ``out`` (default
    ``root``); ``kwargs`` as ``write_report``'s (threshold, window, metric, resume_gap_s)."""
    root = pathlib.Path(root)
    study, cells = study_cells(root)
    return write_report(cells, out or root, title=f"Staleness study {study.get('name', root.name)}", study=study,
                        **kwargs)


def report_paths(paths: list[pathlib.Path], out: pathlib.Path | None, group_by: list[str] = (),
                 **kwargs) -> ReportFiles:
    """The report of the CLI's paths: one study directory (grouped by its ``--grid`` keys), or one
    or more run directories (grouped by the dotted config keys ``group_by`` too, read from each
    run's ``config.yaml``).

    Raises:
        ReportInputError: a path that is neither a run nor a study directory, or given twice; a study directory
            with other paths; several runs without ``out``; a run without metrics; a ``group_by``
            key the report reads already (``OWN_KEYS``) or that is a config section; two runs that
            differ only in a config key outside ``group_by`` (``check_distinct``).
    """
    for path in paths:
        if not path.is_dir() or not (is_study_dir(path) or is_run_dir(path)):
            what = "does not exist" if not path.exists() else "is not a directory" if not path.is_dir() else \
                "holds neither study.json nor metrics.jsonl / config.yaml"
            raise ReportInputError(f"{path} {what}: give a run directory (runs/<name>, with metrics.jsonl) or a "
                                   f"study directory (runs/<study>, with study.json)")
    seen: dict[pathlib.Path, pathlib.Path] = {}
    for path in paths:
        first = seen.setdefault(path.resolve(), path)
        if first is not path:
            raise ReportInputError(f"{path} is given twice (also as {first}): its run would count as two seeds; "
                                   f"give each run directory once")
    studies = [p for p in paths if is_study_dir(p)]
    if studies:
        if len(paths) > 1:
            raise ReportInputError(f"{studies[0]} is a study directory: give it alone (its cells are its runs), "
                                   f"or give run directories only")
        if group_by:
            raise ReportInputError(f"--group-by {' '.join(group_by)}: a study's report is grouped by its own "
                                   f"--grid keys; give --group-by with run directories only")
        return write_study_report(studies[0], out, **kwargs)
    for key in group_by:
        if key in OWN_KEYS:
            raise ReportInputError(f"--group-by {key}: every run's {key} is read already, as the column "
                                   f"{OWN_KEYS[key]}; leave it out of --group-by")
    if out is None and len(paths) > 1:
        raise ReportInputError(f"{len(paths)} run directories and no --out: give --out DIR for their report")
    configs = {p: read_config(p) for p in paths}  # each read once: for its cell and for check_distinct
    cells = [run_cell(p, group_by, configs[p]) for p in paths]
    for key in group_by:
        if all(c.grid[key] is None for c in cells):
            raise ReportInputError(f"--group-by {key}: no run's config.yaml has it; give a dotted config key, e.g. "
                                   f"--group-by trainer.lr")
        if any(isinstance(c.grid[key], dict) for c in cells):
            raise ReportInputError(f"--group-by {key}: it is a section of the config; group by one of its keys, "
                                   f"--group-by {key}.NAME")
    check_distinct(cells, [configs[p] for p in paths])
    title = f"Runs {', '.join(c.name for c in cells)}" if len(cells) <= 4 else f"{len(cells)} runs"
    return write_report(cells, out or paths[0], title=title, strict=True, **kwargs)


def check_distinct(cells: list[Cell], configs: list[dict | None]) -> None:
    """Raise ``ReportInputError`` for two runs of one grid point and seed whose ``config.yaml``
    (``configs``, one per cell, as ``runs.read_config`` gives it) differ (``runs.config_differences``;
    a key one lacks counts): the report would average them and take either as the other's η = 0
    twin; the message names the keys to give as ``--group-by``. The point's own keys (``OWN_KEYS``,
    the keys they replaced, the ``--group-by`` keys) are compared as the cells' values."""
    seen: dict[str, tuple[Cell, dict | None]] = {}
    own = {*OWN_KEYS, *(old for old, (new, _) in RENAMED.items() if new in OWN_KEYS)}
    for cell, config in zip(cells, configs):
        point = json.dumps([cell.eta, cell.objective, cell.interrupt, cell.seed, sorted(cell.grid.items())],
                           default=str)
        other, first = seen.setdefault(point, (cell, config))
        differ = config_differences(first, config, {*own, *cell.grid}) if other is not cell else []
        if differ:
            named = [f"{k} (not in {(other if lacks(first, k) else cell).run_dir / 'config.yaml'})"
                     if lacks(first, k) or lacks(config, k) else k for k in differ[:6]]
            model = ("; model.path counts as the same only where both runs' are one built-in model in their "
                     "model.cache_dir" if "model.path" in differ[:6] else "")
            raise ReportInputError(f"{other.run_dir} and {cell.run_dir} have one η, objective, interruption, seed "
                                   f"and --group-by values but their config.yaml differ in {', '.join(named)}"
                                   f"{model}: the report would mix them; give --group-by {differ[0]} (repeatable) "
                                   f"for each key that tells them apart, or leave one out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=pathlib.Path, help="a study directory, or run directories")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output directory (default: the study's or the single run's directory)")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help=f"rollout metric of the time to threshold, e.g. rollout/reward (default {DEFAULT_METRIC})")
    parser.add_argument("--threshold", default=str(DEFAULT_THRESHOLD),
                        help=f"the metric's value that counts as reached (default {DEFAULT_THRESHOLD}), or start+D: D "
                        f"above the run's start (its first window's mean), e.g. start+0.1")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help=f"steps of the metric's trailing mean (default {DEFAULT_WINDOW})")
    parser.add_argument("--group-by", action="append", default=[], metavar="KEY",
                        help="run directories: also group by this dotted config key (repeatable), e.g. trainer.lr")
    parser.add_argument("--resume-gap-s", type=float, default=RESUME_GAP_S,
                        help=f"an interval this much longer than its step is a resume gap (default {RESUME_GAP_S:g})")
    args = parser.parse_args(argv)
    try:
        files = report_paths(args.paths, args.out, args.group_by, threshold=args.threshold, window=args.window,
                             metric=args.metric, resume_gap_s=args.resume_gap_s)
    except ReportInputError as exc:
        print(f"[report] error: {exc}", file=sys.stderr)
        return 2
    missing = sum(r["state"] == "missing" for r in files.rows)
    print(f"[report] {len(files.rows)} run(s), {missing} without metrics: {files.csv}, {files.html}")
    return 0
