"""The report of a staleness study or of any runs: ``summary.csv`` and a self-contained ``report.html``.

    python tools/report.py runs/<study>                       # a study: written into runs/<study>/
    python tools/report.py RUN_DIR [RUN_DIR ...] [--out DIR]   # any runs (one run: into RUN_DIR)
        [--threshold X] [--window N] [--resume-gap-s S]

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
import sys

import jinja2

from areal_async.report import plots
from areal_async.report.runs import RESUME_GAP_S, ReportInputError, RunMetrics, read_cell_config, read_run
from areal_async.report.summary import COLUMNS, DEFAULT_THRESHOLD, DEFAULT_WINDOW, Cell, summarize, write_csv

HTML_HIDDEN = ("threshold", "window", "run_dir")  # constant or long: stated above the table instead


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
                      interrupt=c.get("interrupt", default), seed=c.get("seed"), state=c.get("state") or "")
                 for c in study["cells"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ReportInputError(f"{path} is not a study record ({exc!r}); it is written by python -m "
                               f"launcher.ablation: run the study again to rewrite it") from None
    return study, cells


def run_cell(run_dir: pathlib.Path) -> Cell:
    cfg = read_cell_config(run_dir)
    return Cell(run_dir.name or str(run_dir), run_dir, eta=cfg["eta"], objective=cfg["objective"],
                interrupt=cfg["interrupt"], seed=cfg["seed"])


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def render_html(title: str, about: str, study: dict | None, rows: list[dict], missing: list[dict],
                notes: list[str], panels: list[plots.Panel], threshold: float, window: int) -> str:
    """``report.html.j2`` rendered (autoescaped): the table of ``rows`` and the panels as data URIs."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(pathlib.Path(__file__).parent), autoescape=True)
    shown = [c for c in COLUMNS if c not in HTML_HIDDEN]
    table = [{"missing": r["state"] == "missing",
              "cells": [{"value": _fmt(r[c]), "text": isinstance(r[c], str)} for c in shown]} for r in rows]
    return env.get_template("report.html.j2").render(
        title=title, about=about, study=study, missing=missing, notes=notes, threshold=threshold, window=window,
        columns=[{"name": c, "description": COLUMNS[c]} for c in shown], rows=table,
        panels=[{"title": p.title, "caption": p.caption, "b64": base64.b64encode(p.png).decode("ascii")}
                for p in panels])


def write_report(cells: list[Cell], out: pathlib.Path, *, title: str, study: dict | None = None,
                 threshold: float = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW,
                 resume_gap_s: float = RESUME_GAP_S, strict: bool = False) -> ReportFiles:
    """Write ``out/summary.csv`` and ``out/report.html`` for ``cells``.

    Args:
        cells: the runs, in the table's order.
        out: output directory (created if missing).
        study: ``study.json``'s record, shown in the report's header.
        threshold: ``rollout/correct`` threshold in [0, 1]; window: steps of its trailing mean (>= 1).
        resume_gap_s: see ``runs.py``.
        strict: a cell without metrics raises instead of being listed as missing.

    Raises:
        ReportInputError: threshold or window out of range; with ``strict``, a cell without metrics.
    """
    if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
        raise ReportInputError(f"threshold {threshold!r}: rollout/correct is a fraction; give a threshold in "
                               f"[0, 1], e.g. --threshold 0.5")
    if window < 1:
        raise ReportInputError(f"window {window}: the trailing mean needs at least 1 step; give --window 1 or more")
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
        rows.append(summarize(cell, run, threshold, window))
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", rows)
    groups = plots.groups_of(read)
    panels = [p for p in (plots.learning_curves(groups, "step", window, threshold),
                          plots.learning_curves(groups, "wall", window, threshold),
                          plots.eval_curves(groups), plots.throughput(rows), plots.interruption(rows),
                          plots.staleness_histograms(groups), plots.diagnostics(groups),
                          plots.episodes(groups)) if p is not None]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    about = (f"{len(cells)} run(s), {len(missing)} without metrics; written {when} from each run's "
             f"metrics.jsonl (each step once, the last occurrence wins).")
    (out / "report.html").write_text(render_html(title, about, study, rows, missing, notes, panels,
                                                 threshold, window))
    return ReportFiles(out / "summary.csv", out / "report.html", rows)


def write_study_report(root: pathlib.Path, out: pathlib.Path | None = None, **kwargs) -> ReportFiles:
    """The report of the study in ``root`` (``study.json``), written into ``out`` (default
    ``root``); ``kwargs`` as ``write_report``'s (threshold, window, resume_gap_s)."""
    root = pathlib.Path(root)
    study, cells = study_cells(root)
    return write_report(cells, out or root, title=f"Staleness study {study.get('name', root.name)}", study=study,
                        **kwargs)


def report_paths(paths: list[pathlib.Path], out: pathlib.Path | None, **kwargs) -> ReportFiles:
    """The report of the CLI's paths: one study directory, or one or more run directories.

    Raises:
        ReportInputError: a path that is neither a run nor a study directory; a study directory
            with other paths; several runs without ``out``; a run without metrics.
    """
    for path in paths:
        if not path.is_dir() or not (is_study_dir(path) or is_run_dir(path)):
            what = "does not exist" if not path.exists() else "is not a directory" if not path.is_dir() else \
                "holds neither study.json nor metrics.jsonl / config.yaml"
            raise ReportInputError(f"{path} {what}: give a run directory (runs/<name>, with metrics.jsonl) or a "
                                   f"study directory (runs/<study>, with study.json)")
    studies = [p for p in paths if is_study_dir(p)]
    if studies:
        if len(paths) > 1:
            raise ReportInputError(f"{studies[0]} is a study directory: give it alone (its cells are its runs), "
                                   f"or give run directories only")
        return write_study_report(studies[0], out, **kwargs)
    if out is None and len(paths) > 1:
        raise ReportInputError(f"{len(paths)} run directories and no --out: give --out DIR for their report")
    cells = [run_cell(p) for p in paths]
    title = f"Runs {', '.join(c.name for c in cells)}" if len(cells) <= 4 else f"{len(cells)} runs"
    return write_report(cells, out or paths[0], title=title, strict=True, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=pathlib.Path, help="a study directory, or run directories")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output directory (default: the study's or the single run's directory)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"rollout/correct threshold for wall_s_to_threshold (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help=f"steps of the trailing mean of rollout/correct (default {DEFAULT_WINDOW})")
    parser.add_argument("--resume-gap-s", type=float, default=RESUME_GAP_S,
                        help=f"an interval this much longer than its step is a resume gap (default {RESUME_GAP_S:g})")
    args = parser.parse_args(argv)
    try:
        files = report_paths(args.paths, args.out, threshold=args.threshold, window=args.window,
                             resume_gap_s=args.resume_gap_s)
    except ReportInputError as exc:
        print(f"[report] error: {exc}", file=sys.stderr)
        return 2
    missing = sum(r["state"] == "missing" for r in files.rows)
    print(f"[report] {len(files.rows)} run(s), {missing} without metrics: {files.csv}, {files.html}")
    return 0
