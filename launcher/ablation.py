"""A staleness ablation study in one command: the grid η × objective × seed, one whole job per cell.

    python -m launcher.ablation CONFIG --etas 0,1,2,4,8 [--objectives decoupled,naive] [--seeds 1,2,3]
        [--interrupt on,off] [--grid KEY=V1,V2,...]... [--name STUDY] [--parallel N] [override ...]

Each cell is ``launcher.local CONFIG`` with its grid values as overrides, in
``<run_root>/<study>/<cell>/``, so within a seed only η, the objective and the ``--grid`` keys
(any config key: ``launcher/study_grid.py``) differ. Resumable: run it again. ``study.json``
records the grid and each cell's state; the report is written at the end.
Cells, order, exit statuses, ``study.json``: docs/dashboards.md#what-a-study-runs-and-records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time
import traceback
import typing

from areal_async.config import Objective, load_config
from areal_async.config_hints import RENAMED, renamed_hint
from areal_async.file_lock import file_lock
from areal_async.progress import progress_mode
from launcher.jobs import Job, local_argv, run_jobs
from launcher.local import interrupt_on_signals
from launcher.study_grid import Axis, fit_name, name_suffix, parse_grid, point_overrides, point_tags, points

OBJECTIVES = typing.get_args(Objective)  # the values of algo.objective
# set by the study for each cell: an override of one of these would make the cells not a grid
GRID_KEYS = ("name", "queue.max_staleness", "algo.objective", "seed", "rollout.interrupt_on_update",
             "logging.wandb_group", "logging.wandb_tags")
INTERRUPTS = {"on": True, "off": False}  # --interrupt → rollout.interrupt_on_update
SETS_ITSELF = ("(η: --etas, objective: --objectives, seed: --seeds, interruption: --interrupt, study name: "
               "--name, run_root: an override for every cell)")
# a config key the study sets → its flag: what replaces a removed key (config_hints.RENAMED) that maps to it
FLAGS = {"algo.objective": "--objectives", "queue.max_staleness": "--etas", "seed": "--seeds"}
IDENTITY = ("config", "overrides", "etas", "objectives", "seeds", "interrupts", "grid")
IDENTITY_DEFAULTS = {"interrupts": ["on"], "grid": []}  # of a study.json written before the key existed


def cell_name(eta: int, objective: str, seed: int, interrupt: str = "on", point: dict | None = None,
              axes: list[Axis] = ()) -> str:
    """``eta<η>-<objective>-s<seed>``, with ``-nointerrupt`` only off the default, then the grid
    point's ``-<key><value>`` per ``--grid`` axis (``study_grid.name_suffix``, cut by
    ``study_grid.fit_name``): the names of studies without these axes stay."""
    name = f"eta{eta}-{objective}-s{seed}" + ("" if INTERRUPTS[interrupt] else "-nointerrupt")
    return fit_name(name + name_suffix(point, list(axes)), point) if axes else name


def parse_ints(flag: str, text: str, what: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; raises ``ValueError`` naming the value for a non-integer, a
    negative or a repeated one."""
    values = []
    for item in text.split(","):
        try:
            if not item.strip().lstrip("+-").isdigit():  # int() would read "1_0" as 10
                raise ValueError
            value = int(item.strip())
        except ValueError:
            raise ValueError(f"{flag} {text}: {item.strip()!r} is not an integer; give each {what} as an "
                             f"integer, comma-separated, e.g. {flag} 0,1,2") from None
        if value < 0:
            why = " (η = 0 is synchronous RL)" if what == "η" else ""
            raise ValueError(f"{flag} {text}: {value} is negative; each {what} must be >= 0{why}")
        if value in values:
            raise ValueError(f"{flag} {text}: {value} is given twice; give each {what} once")
        values.append(value)
    return values


def parse_choices(flag: str, text: str, allowed, unknown: str) -> list[str]:
    """``"a,b"`` → ``["a", "b"]``, each in ``allowed``; raises ``ValueError`` naming an unknown value
    (``unknown``: what to give instead) or a repeated one."""
    values = []
    for item in text.split(","):
        value = item.strip()
        if value not in allowed:
            raise ValueError(f"{flag} {text}: {value!r} is not {unknown}")
        if value in values:
            raise ValueError(f"{flag} {text}: {value!r} is given twice; give each value once")
        values.append(value)
    return values


def parse_objectives(text: str) -> list[str]:
    """``"decoupled,naive"`` → ``["decoupled", "naive"]`` (``parse_choices``)."""
    return parse_choices("--objectives", text, OBJECTIVES, f"an objective; choose from {', '.join(OBJECTIVES)}")


def parse_interrupts(text: str) -> list[str]:
    """``"on,off"`` → ``["on", "off"]`` (``parse_choices``)."""
    return parse_choices("--interrupt", text, INTERRUPTS, "on or off; give on (weight updates interrupt the "
                         "generations in flight), off (they wait for them) or on,off")


def cell_overrides(eta: int, objective: str, seed: int, study: str, root: pathlib.Path,
                   interrupt: str = "on", point: dict | None = None, axes: list[Axis] = ()) -> list[str]:
    """The overrides that make a cell of the grid (after the study's own overrides); ``point``:
    the cell's value of each ``--grid`` axis of ``axes``."""
    point = point or {}
    tags = [f"eta={eta}", f"objective={objective}", f"seed={seed}"] + (
        [] if INTERRUPTS[interrupt] else ["interrupt=off"]) + point_tags(point)
    return [f"name={cell_name(eta, objective, seed, interrupt, point, axes)}", f"run_root={root}",
            f"queue.max_staleness={eta}",
            f"algo.objective={objective}", f"seed={seed}",
            f"rollout.interrupt_on_update={'true' if INTERRUPTS[interrupt] else 'false'}", *point_overrides(point),
            f"logging.wandb_group={json.dumps(study)}", f"logging.wandb_tags={json.dumps(tags)}"]


def cell_state(run_dir: pathlib.Path, total_steps: int) -> tuple[str, int]:
    """``("finished" | "resumable" | "broken" | "new", checkpoint step)`` of a cell's run directory."""
    if not run_dir.is_dir():
        return "new", 0
    try:
        step = int(json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = 0
    last = -1
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if "train/loss" in row:
                    last = max(last, int(row["step"]))
    except OSError:
        pass
    if step >= total_steps and last >= total_steps - 1:
        return "finished", step
    return ("resumable" if 0 < step < total_steps else "broken"), step


def grid_text(axes: list[dict]) -> str:
    """``"trainer.lr [1e-06, 1e-05] × rollout.max_new_tokens [256, 1024]"`` of ``study.json``'s
    ``grid``; ``"none"`` without axes."""
    return " × ".join(f"{a['key']} {json.dumps(a['values'])}" for a in axes) or "none"


def _identity_text(study: dict) -> str:
    interrupts = study.get("interrupts", IDENTITY_DEFAULTS["interrupts"])
    return (f"etas {study['etas']}, objectives {study['objectives']}, seeds {study['seeds']}, interrupt "
            f"{interrupts}, grid {grid_text(study.get('grid', []))}, config {study['config']}, overrides "
            f"{study['overrides']}")


def open_study(root: pathlib.Path, study: dict) -> dict:
    """``study.json`` of ``root``: created from ``study``, or the existing one if it has the same
    identity. Raises ``ValueError`` naming both grids and the fix if it has another."""
    path = root / "study.json"
    if path.exists():
        old = read_study(path)
        differ = [k for k in IDENTITY if old.get(k, IDENTITY_DEFAULTS.get(k)) != study[k]]
        if differ:  # the config path and the overrides compare as given (order and spelling count)
            raise ValueError(f"study '{study['name']}' in {root} differs in {', '.join(differ)}: it was run with "
                             f"{_identity_text(old)}; this "
                             f"command gives {_identity_text(study)}. Give a new study name (--name ...) for "
                             f"this grid, or the same grid to continue that study")
        states = {c["name"]: c for c in old.get("cells", [])}
        for cell in study["cells"]:
            cell.update({k: states[cell["name"]][k] for k in ("state", "error") if cell["name"] in states})
    root.mkdir(parents=True, exist_ok=True)
    write_study(root, study)
    return study


def read_study(path: pathlib.Path) -> dict:
    """An existing ``study.json``; raises ``ValueError`` naming it and the fix where it is not
    JSON or lacks a key of the study's identity or its cells."""
    try:
        old = json.loads(path.read_text())
        lacks = [k for k in (*IDENTITY, "cells") if k not in IDENTITY_DEFAULTS and k not in old]
        if lacks or not all(isinstance(c, dict) and "name" in c for c in old["cells"]):
            raise ValueError(f"no {', '.join(lacks) or 'name in each of its cells'}")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a study record ({exc}); python -m launcher.ablation writes it: move it "
                         f"away to start the record again (finished cells are found by their run directories "
                         f"and skipped), or give another --name") from None
    return old


def write_study(root: pathlib.Path, study: dict) -> None:
    tmp = root / "study.json.tmp"
    tmp.write_text(json.dumps(study, indent=1) + "\n")
    tmp.replace(root / "study.json")


OOM_MARKS = ("CUDA out of memory", "OutOfMemoryError")  # torch's words for a device allocation that failed


def error_line(job: Job) -> str:
    """The launcher's own error line of a failed cell (``[launcher] error: ...`` / ``job failed``),
    else its last line."""
    lines = job.last_lines(200)
    marks = ("[launcher] error:", "[launcher] job failed:", "[launcher] interrupted")
    return next((ln for ln in lines if ln.startswith(marks)), lines[-1] if lines else "(no output)")


class StudyProgress:
    """Cells done of N with an ETA: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, name: str, total: int, skipped: int, bar: bool):
        self.total, self.done, self.failed, self.t0 = total, skipped, 0, time.monotonic()
        self.ran = 0  # cells ended in this invocation: the ETA's rate
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=skipped, desc=f"study {name}", unit="cell", file=sys.stdout,
                            dynamic_ncols=True)

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def ended(self, ok: bool) -> None:
        self.done, self.ran, self.failed = self.done + 1, self.ran + 1, self.failed + (not ok)
        if self.bar is not None:
            self.bar.set_postfix(failed=self.failed)
            self.bar.update(1)
            return
        minutes = (time.monotonic() - self.t0) / 60
        eta = minutes / self.ran * (self.total - self.done)
        print(f"[ablation] {self.done}/{self.total} cells done ({self.failed} failed), {minutes:.1f} min, "
              f"ETA {eta:.1f} min", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_study(args: argparse.Namespace) -> int:
    etas = parse_ints("--etas", args.etas, "η")
    objectives = parse_objectives(args.objectives)
    interrupts = parse_interrupts(args.interrupt)
    for flag, text in [*(("override", o) for o in args.overrides), *(("--grid", g) for g in args.grid)]:
        if (key := text.partition("=")[0].strip()) in RENAMED:
            raise ValueError(f"{flag} {text}: config key '{key}' is gone: "
                             f"{renamed_hint(key, FLAGS.get(RENAMED[key][0], ''))}")
    cfg = load_config(args.config, args.overrides)  # a bad override fails here, before any cell
    seeds = parse_ints("--seeds", args.seeds, "seed") if args.seeds else [cfg.seed]
    given = {o.partition("=")[0].strip() for o in args.overrides}
    for key in GRID_KEYS:
        if key in given:
            raise ValueError(f"override {key}=...: the study sets {key} for each cell; leave it out {SETS_ITSELF}")
    reserved = dict.fromkeys((*GRID_KEYS, "run_root"), f"leave it out of --grid {SETS_ITSELF}")
    axes = parse_grid(args.grid, args.config, args.overrides, reserved)
    if args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: at least one cell must run at a time; give 1 or more")
    name = args.name or f"{cfg.name}-ablation"
    load_config(None, [f"name={json.dumps(name)}"])  # the same rule as a run name: ValueError naming it
    root = pathlib.Path(cfg.run_root) / name
    total = cfg.trainer.total_steps
    grid = [(e, o, s, i, p) for s in seeds for p in points(axes) for e in etas for o in objectives
            for i in interrupts]
    varied = any(a.key == "trainer.total_steps" for a in axes)  # then no one step count is every cell's
    study = {"name": name, "config": args.config, "overrides": list(args.overrides),
             "total_steps": None if varied else total,
             "etas": etas, "objectives": objectives, "seeds": seeds, "interrupts": interrupts,
             "grid": [a.record() for a in axes],
             "cells": [{"name": cell_name(e, o, s, i, p, axes), "eta": e, "objective": o, "seed": s, "interrupt": i,
                        "grid": p, "state": "pending", "error": None} for e, o, s, i, p in grid]}
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:  # one process per study: two would run the same cells
        try:
            held.enter_context(file_lock(root / ".study.lock", wait=False))
        except BlockingIOError:
            raise ValueError(f"study '{name}' in {root} is being run by another process; wait for it, or "
                             f"give another --name") from None
        return _run_cells(args, study, root, grid, axes, total)


def _run_cells(args, study: dict, root: pathlib.Path, grid: list, axes: list[Axis], total: int) -> int:
    study = open_study(root, study)
    cells = {c["name"]: c for c in study["cells"]}
    jobs, skipped, how = [], 0, {}
    for eta, objective, seed, interrupt, point in grid:
        name = cell_name(eta, objective, seed, interrupt, point, axes)
        state, step = cell_state(root / name, int(point.get("trainer.total_steps", total)))  # a grid may vary it
        if state == "finished":
            skipped += 1
            cells[name].update(state="finished", error=None)
            continue
        flags = {"resumable": ["--resume"], "broken": ["--overwrite"], "new": []}[state]
        overrides = [*args.overrides, *cell_overrides(eta, objective, seed, study["name"], root, interrupt, point,
                                                      axes)]
        job = Job(name, local_argv(args.config, overrides, flags), root / f"{name}.out")
        how[name] = {"resumable": f"resumed at step {step}", "broken": "again from scratch", "new": "new"}[state]
        jobs.append(job)
    write_study(root, study)
    shape = f"η {study['etas']} × {study['objectives']} × seeds {study['seeds']}" + (
        f" × interrupt {study['interrupts']}" if study["interrupts"] != IDENTITY_DEFAULTS["interrupts"] else "") + (
        f" × {grid_text(study['grid'])}" if study["grid"] else "")
    progress = StudyProgress(study["name"], len(grid), skipped, bar=progress_mode() == "bar")
    progress.say(f"[ablation] study '{study['name']}' in {root}: {shape} = {len(grid)} cells, {skipped} "
                 f"finished before, {len(jobs)} to run, {max(1, min(args.parallel, len(jobs)))} at a time")
    failed: list[Job] = []

    def started(job: Job) -> None:
        progress.say(f"[ablation] {job.name}: started ({how[job.name]}); output in {job.out}")

    def ended(job: Job) -> None:
        ok = job.returncode == 0
        minutes = (time.monotonic() - job.started_s) / 60
        cells[job.name].update(state="finished" if ok else "failed",
                               error=None if ok else f"{job.exit_text()}: {error_line(job)}")
        write_study(root, study)
        if ok:
            progress.say(f"[ablation] {job.name}: finished in {minutes:.1f} min")
        else:
            failed.append(job)
            progress.say(f"[ablation] {job.name}: FAILED after {minutes:.1f} min ({job.exit_text()}): "
                         f"{error_line(job)}")
        progress.ended(ok)

    try:
        run_jobs(jobs, args.parallel, on_start=started, on_end=ended, poll_s=args.poll_s)
    except KeyboardInterrupt:
        progress.close()
        print("[ablation] interrupted; the running cells were stopped (run the same command to go on)",
              file=sys.stderr, flush=True)
        return 130
    progress.close()
    out_of_memory = []
    for job in failed:
        lines = job.last_lines(400)  # read once: its tail is shown, all of them are searched for out-of-memory
        tail = "\n".join(f"    {line}" for line in lines[-12:])
        print(f"[ablation] failed cell {job.name} ({job.exit_text()}); last lines of {job.out}:\n{tail}",
              file=sys.stderr, flush=True)
        if any(m in line for line in lines for m in OOM_MARKS):
            out_of_memory.append(job.name)
    if out_of_memory and args.parallel > 1:
        print(f"[ablation] {len(out_of_memory)} failed cell(s) ran out of device memory with up to {args.parallel} "
              f"side by side ({', '.join(out_of_memory)}): run the same command with a smaller --parallel to run "
              f"them again (finished cells are skipped)", file=sys.stderr, flush=True)
    done = sum(c["state"] == "finished" for c in study["cells"])
    print(f"[ablation] {done}/{len(grid)} cells finished, {len(failed)} failed; study in {root}", flush=True)
    write_report(root)
    return 1 if failed else 0


def write_report(root: pathlib.Path) -> None:
    """The study's ``summary.csv`` and ``report.html`` (``areal_async/report``); a report that cannot
    be written is said, and does not change the study's exit status."""
    from areal_async.report import ReportInputError, write_study_report  # matplotlib: only when reporting

    try:
        files = write_study_report(root)
    except (ReportInputError, OSError) as exc:
        print(f"[ablation] no report: {exc}", file=sys.stderr, flush=True)
        return
    except Exception:  # a fault of the report: said with its traceback; the cells' outcome stands
        traceback.print_exc()
        print(f"[ablation] no report: the report failed (above); write it again with python tools/report.py {root}",
              file=sys.stderr, flush=True)
        return
    print(f"[ablation] report: {files.html} (table: {files.csv})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.ablation", description=__doc__,
                                     usage="%(prog)s [-h] config --etas ETAS [--objectives ...] [--seeds ...] "
                                           "[--interrupt on,off] [--grid KEY=V1,V2 ...] [--name STUDY] [--parallel N] "
                                           "[overrides ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML, e.g. configs/quickstart_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every cell, e.g. trainer.total_steps=40")
    parser.add_argument("--etas", required=True, help="max staleness values η, e.g. 0,1,2,4,8")
    parser.add_argument("--objectives", default="decoupled,naive",
                        help=f"values of algo.objective: {', '.join(OBJECTIVES)} (default decoupled,naive)")
    parser.add_argument("--seeds", default="", help="run seeds, e.g. 1,2,3 (default: the config's seed)")
    parser.add_argument("--interrupt", default="on", help="on (weight updates interrupt the generations in "
                        "flight, the default), off (they wait for them: rollout.interrupt_on_update=false) or on,off")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="vary any config key over these values, one cell each (repeatable), e.g. "
                        "--grid trainer.lr=1e-6,1e-5; values are parsed as the key's type")
    parser.add_argument("--name", default="", help="study name: its directory under run_root "
                                                   "(default: <config name>-ablation)")
    parser.add_argument("--parallel", type=int, default=1, help="cells run side by side (default 1)")
    parser.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    with interrupt_on_signals():
        try:
            return run_study(args)
        except (ValueError, FileNotFoundError) as exc:
            print(f"[ablation] error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("[ablation] interrupted", file=sys.stderr, flush=True)
            return 130


if __name__ == "__main__":
    sys.exit(main())
