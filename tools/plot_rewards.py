"""Plot reward curves of one or more runs from their ``metrics.jsonl``.

    python tools/plot_rewards.py runs/quickstart_cpu [runs/other ...] --out docs/reward_curve.png

Left: mean rollout reward per training step (dashed, right axis: ``--key``, by default the
fraction of correct samples); right: the
same against wall-clock minutes since the first step. Start/end evaluation (``eval/pass@1``) is
marked where the run logged it.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist; pass a run directory such as runs/<name>")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reward_curve.png"))
    parser.add_argument("--key", default="rollout/correct", help="second metric to draw")
    args = parser.parse_args()

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    ax_key = ax_step.twinx()
    ax_key.set_ylabel(args.key)
    for run in args.runs:
        rows = [r for r in read_metrics(run) if "rollout/reward" in r]
        if not rows:
            raise SystemExit(f"{run}: no step has rollout/reward yet")
        steps = [r["step"] for r in rows]
        minutes = [(r["time"] - rows[0]["time"]) / 60 for r in rows]
        reward = [r["rollout/reward"] for r in rows]
        line, = ax_step.plot(steps, reward, marker=".", label=f"{run.name} reward")
        ax_time.plot(minutes, reward, marker=".", color=line.get_color(), label=f"{run.name}")
        if all(args.key in r for r in rows):
            ax_key.plot(steps, [r[args.key] for r in rows], ls="--", color=line.get_color(),
                        alpha=0.6)
        for r in read_metrics(run):
            if "eval/pass@1" in r:
                ax_step.annotate(f"eval pass@1 {r['eval/pass@1']:.2f}", (r["step"], reward[0]),
                                 fontsize=8, color=line.get_color())
    ax_step.set_xlabel("training step")
    ax_step.set_ylabel("mean rollout reward")
    ax_time.set_xlabel("wall-clock minutes")
    ax_time.set_ylabel("mean rollout reward")
    ax_step.legend(loc="upper left", fontsize=8)
    ax_time.legend(loc="upper left", fontsize=8)
    for ax in (ax_step, ax_time):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
