"""Learning runs side by side on one machine, and the table that judges them.

    # several jobs at once (one GPU or CPU), each with its own ports, then the table:
    python tools/learning_table.py run configs/quickstart_cpu.yaml --run-root runs/grid \\
        --common "trainer.total_steps=100 inference.device=cuda:0 trainer.device=cuda" \\
        --job fp32_s1 "model.dtype=float32 trainer.dtype=float32 seed=1" \\
        --job bf16_s1 "model.dtype=bfloat16 trainer.dtype=bfloat16 seed=1"

    # the table of finished (or running) run directories:
    python tools/learning_table.py table runs/grid/*

The table reads each run's ``metrics.jsonl``: rollout ``correct`` (fraction of correct samples) in
blocks of ``--block`` steps (first, best and last block, and the worst block after the first),
greedy ``eval/pass@1`` at the first and the last evaluation, ``train/entropy`` in the first and
the last block, and minutes from the first record to the last. The three checks of a recipe that
holds (docs/recipe.md):

- ``gain``: last block ≥ first block + 0.15;
- ``eval``: last evaluation ≥ first evaluation + 0.10;
- ``hold``: no block after the first is more than 0.05 below the first.

A block of 32 samples per step is noisy by about ±0.05, and one run is an anecdote: compare seeds.
Each job of ``run`` is ``python -m launcher.local CONFIG name=JOB run_root=RUN_ROOT`` plus the
common and the job's own overrides, all started side by side (``launcher/jobs.py``; every port is
chosen free at start, so the jobs do not collide); its console output goes to ``RUN_ROOT/JOB.out``.
A failed job is reported in the table (``failed``, with its last line) and the others go on.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repository's launcher
from launcher.jobs import Job, local_argv, run_jobs as run_jobs_side_by_side  # noqa: E402


def read_rows(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def blocks(values: list[float], size: int) -> list[float]:
    """Means of consecutive blocks of ``size`` values (a last partial block of ≥ size/2 kept)."""
    out = []
    for i in range(0, len(values), size):
        chunk = values[i:i + size]
        if len(chunk) >= max(1, size // 2):
            out.append(sum(chunk) / len(chunk))
    return out


def summarize(run_dir: pathlib.Path, block: int) -> dict:
    """One row of the table for ``run_dir`` (keys below; ``None`` where a value is missing)."""
    rows = read_rows(run_dir)
    steps = [r for r in rows if "perf/step_s" in r]  # every training step's row (rollout/correct: a scored one)
    evals = [r for r in rows if "eval/pass@1" in r]
    correct = [r["rollout/correct"] for r in steps if "rollout/correct" in r]
    entropy = [r["train/entropy"] for r in steps if "train/entropy" in r]
    b = blocks(correct, block)
    e = blocks(entropy, block)
    row = {"run": run_dir.name, "steps": len(steps), "first": None, "best": None, "last": None,
           "worst_later": None, "eval0": None, "eval1": None, "ent0": None, "ent1": None,
           "minutes": None, "gain": None, "eval": None, "hold": None}
    if rows:
        row["minutes"] = (rows[-1]["time"] - rows[0]["time"]) / 60
    if b:
        row.update(first=b[0], best=max(b), last=b[-1])
        if len(b) > 1:
            row["worst_later"] = min(b[1:])
            row["gain"] = b[-1] >= b[0] + 0.15
            row["hold"] = min(b[1:]) >= b[0] - 0.05
    if e:
        row.update(ent0=e[0], ent1=e[-1])
    if len(evals) >= 2:
        row.update(eval0=evals[0]["eval/pass@1"], eval1=evals[-1]["eval/pass@1"])
        row["eval"] = evals[-1]["eval/pass@1"] >= evals[0]["eval/pass@1"] + 0.10
    elif evals:
        row["eval0"] = evals[0]["eval/pass@1"]
    return row


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def print_table(run_dirs: list[pathlib.Path], block: int, notes: dict[str, str] | None = None) -> None:
    cols = ["run", "steps", "first", "best", "last", "worst_later", "eval0", "eval1", "ent0", "ent1",
            "minutes", "gain", "eval", "hold"]
    print(f"rollout correct in {block}-step blocks; eval = greedy pass@1 (first → last evaluation)")
    print("| " + " | ".join(cols) + " | note |")
    print("|" + "---|" * (len(cols) + 1))
    for run in run_dirs:
        row = summarize(run, block)
        note = (notes or {}).get(run.name, "")
        print("| " + " | ".join(_fmt(row[c]) for c in cols) + f" | {note} |")
    sys.stdout.flush()


def run_jobs(args: argparse.Namespace) -> int:
    root = pathlib.Path(args.run_root)
    root.mkdir(parents=True, exist_ok=True)
    common = shlex.split(args.common)
    jobs = [Job(name, local_argv(args.config, [f"name={name}", f"run_root={root}", *common, *shlex.split(overrides)],
                                 ["--overwrite"] if args.overwrite else []), root / f"{name}.out")
            for name, overrides in args.job]
    t0, last = time.monotonic(), [time.monotonic()]

    def progress(running: list[Job]) -> None:
        if time.monotonic() - last[0] < args.progress_s:
            return
        last[0] = time.monotonic()
        done = {j.name: len([r for r in read_rows(root / j.name) if "perf/step_s" in r]) for j in jobs}
        print(f"[grid] {(time.monotonic() - t0) / 60:.1f} min: " + ", ".join(f"{n} {s}" for n, s in done.items()),
              flush=True)

    on_time = run_jobs_side_by_side(jobs, len(jobs), on_start=lambda j: print(f"[grid] {j.name}: {' '.join(j.argv[3:])}",
                                                                            flush=True),
                                    on_poll=progress, stagger_s=args.stagger_s, deadline_s=args.deadline_s, grace_s=60)
    if not on_time:
        print(f"[grid] deadline of {args.deadline_s:.0f} s reached: the jobs still running were interrupted", flush=True)
    notes = {}
    for job in jobs:
        if job.returncode != 0:
            last_line = (job.last_lines(1) or [""])[0][-160:]
            notes[job.name] = f"failed ({job.exit_text()}): {last_line}"
    print_table([root / j.name for j in jobs], args.block, notes)
    return 1 if notes else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run jobs side by side, then print the table")
    run.add_argument("config")
    run.add_argument("--run-root", default="runs/grid")
    run.add_argument("--common", default="", help="overrides given to every job")
    run.add_argument("--job", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True)
    run.add_argument("--stagger-s", type=float, default=2.0, help="pause between job starts")
    run.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    run.add_argument("--block", type=int, default=10)
    run.add_argument("--deadline-s", type=float, default=0.0,
                     help="interrupt jobs still running after this many seconds (0: none), then print the table")
    run.add_argument("--overwrite", action="store_true")
    table = sub.add_parser("table", help="print the table of run directories")
    table.add_argument("runs", nargs="+", type=pathlib.Path)
    table.add_argument("--block", type=int, default=10)
    args = parser.parse_args(argv)
    if args.cmd == "table":
        print_table([r for r in args.runs if r.is_dir()], args.block)
        return 0
    return run_jobs(args)


if __name__ == "__main__":
    raise SystemExit(main())
