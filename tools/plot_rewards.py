"""Plot reward curves of one or more runs from their ``metrics.jsonl``.

    python tools/plot_rewards.py runs/quickstart_cpu [runs/other ...] --out docs/reward_curve.png

Left: mean rollout reward per training step (faint: each step's batch; bold: moving mean over
``--window`` steps). Right: fraction of correct rollout samples against wall-clock minutes since
the job's first record, with the greedy evaluation pass@1 (``eval/pass@1``, logged at the start
and the end) as large markers.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist; pass a run directory such as runs/<name>")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_mean(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    v = np.asarray(values, dtype=float)
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reward_curve.png"))
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in args.runs:
        rows = read_metrics(run)
        steps_rows = [r for r in rows if "rollout/reward" in r]
        if not steps_rows:
            raise SystemExit(f"{run}: no step has rollout/reward yet")
        t0 = rows[0]["time"]
        steps = [r["step"] for r in steps_rows]
        reward = [r["rollout/reward"] for r in steps_rows]
        correct = [r["rollout/correct"] for r in steps_rows]
        minutes = [(r["time"] - t0) / 60 for r in steps_rows]
        line, = ax_step.plot(steps, moving_mean(reward, args.window), lw=2,
                             label=f"{run.name} ({args.window}-step mean)")
        color = line.get_color()
        ax_step.plot(steps, reward, color=color, alpha=0.3, marker=".", lw=1)
        ax_time.plot(minutes, moving_mean(correct, args.window), lw=2, color=color,
                     label=f"{run.name} rollout correct ({args.window}-step mean)")
        ax_time.plot(minutes, correct, color=color, alpha=0.3, marker=".", lw=1)
        evals = [r for r in rows if "eval/pass@1" in r]
        if evals:
            ax_time.plot([(r["time"] - t0) / 60 for r in evals], [r["eval/pass@1"] for r in evals],
                         ls="none", marker="D", ms=8, color=color, label=f"{run.name} eval pass@1 (greedy)")
    ax_step.set_xlabel("training step")
    ax_step.set_ylabel("mean rollout reward")
    ax_time.set_xlabel("wall-clock minutes since start")
    ax_time.set_ylabel("fraction correct")
    for ax in (ax_step, ax_time):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
