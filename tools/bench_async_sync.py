"""End-to-end trained tokens per second, synchronous (η = 0) vs asynchronous (η = 2), one config.

    CUDA_VISIBLE_DEVICES=1,0 python tools/bench_async_sync.py configs/async_vs_sync_gpu.yaml \
        [--staleness 0 2] [--skip-steps 1] [--shape 0.6b] [--gpus 0 1] [override ...]

Runs ``python -m launcher.local CONFIG [overrides] name=<config name>_eta<η>
queue.max_staleness=<η> --overwrite`` once per η, one after the other, and reads each run's
``metrics.jsonl``. If ``model.path`` does not exist, a random ``--shape`` checkpoint is written
there first (``tools/qwen3_shapes.py``).

Numbers, over the steps after the first ``--skip-steps`` (start-up and warm-up left out):

- **trained tok/s**: Σ ``train/tokens`` of those steps / wall seconds between the end of step
  ``skip - 1`` and the end of the last step (the ``time`` stamps of ``metrics.jsonl``);
- **trainer idle**: 1 − Σ ``perf/train_s`` / Σ ``perf/step_s`` (waiting for a batch and
  broadcasting weights count as idle);
- **GPU busy**: NVML ``utilization.gpu`` of each ``--gpus`` index (physical numbering, whatever
  ``CUDA_VISIBLE_DEVICES`` says), sampled every 0.5 s over the same wall interval: the share of
  time a kernel was running, so a launch-bound server reads busy while doing little work.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class UtilSampler:
    """NVML utilization of some GPUs every ``period_s`` in a thread (no-op without NVML)."""

    def __init__(self, gpus: list[int], period_s: float = 0.5):
        self.gpus, self.period_s, self.samples = gpus, period_s, []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
            self._nvml = pynvml
        except Exception:  # no NVML here (CPU machine): report nothing
            self._handles = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.time(), util))

    def __enter__(self):
        if self._handles:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._handles:
            self._thread.join()

    def busy(self, start: float, end: float) -> list[float]:
        window = [u for t, u in self.samples if start <= t <= end]
        if not window:
            return [float("nan")] * len(self.gpus)
        return [sum(u[i] for u in window) / len(window) / 100 for i in range(len(self.gpus))]


def summarize(run_dir: pathlib.Path, skip: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in rows if "perf/step_s" in r), key=lambda r: r["step"])
    assert len(steps) > skip + 1, f"{run_dir}: {len(steps)} steps logged, need more than {skip + 1}"
    timed = steps[skip:]
    start = steps[skip - 1]["time"] if skip > 0 else timed[0]["time"] - timed[0]["perf/step_s"]
    end = timed[-1]["time"]
    tokens = sum(r["train/tokens"] for r in timed)
    train_s = sum(r["perf/train_s"] for r in timed)
    step_s = sum(r["perf/step_s"] for r in timed)
    return {"steps": len(timed), "tokens": tokens, "wall_s": end - start, "tok_s": tokens / (end - start),
            "step_s": step_s / len(timed), "train_s": train_s / len(timed),
            "trainer_idle": 1 - train_s / step_s, "start": start, "end": end,
            "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in timed) / len(timed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--gpus", type=int, nargs="*", default=[0, 1], help="NVML indices to sample (server, trainer)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from areal_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    if not pathlib.Path(cfg.model.path).exists():
        from qwen3_shapes import write_model_dir

        write_model_dir(args.shape, cfg.model.path)
    results = {}
    for eta in args.staleness:
        name = f"{cfg.name}_eta{eta}"
        # the run's own name and η come last, so they win over the same keys in ``overrides``
        cmd = [sys.executable, "-m", "launcher.local", args.config, *args.overrides, f"name={name}",
               f"queue.max_staleness={eta}", "--overwrite"]
        print("+", " ".join(cmd), flush=True)
        with UtilSampler(args.gpus) as sampler:
            subprocess.run(cmd, cwd=REPO, check=True, timeout=args.timeout_s)
        res = summarize(REPO / cfg.run_root / name, args.skip_steps)
        res["gpu_busy"] = sampler.busy(res["start"], res["end"])
        results[eta] = res
        print(json.dumps({"eta": eta, **res}), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))

    print(f"\n{args.config} {' '.join(args.overrides)}: {cfg.queue.batch_size} groups x "
          f"{cfg.rollout.n_samples} samples per step, steps after the first {args.skip_steps}")
    gpu_cols = "".join(f" {'GPU' + str(g) + ' busy':>10}" for g in args.gpus)
    print(f"{'eta':>4} {'steps':>6} {'tokens':>8} {'wall s':>7} {'step s':>7} {'train s':>8} "
          f"{'trained tok/s':>14} {'trainer idle':>13}{gpu_cols}")
    for eta, r in results.items():
        busy = "".join(f" {b:>10.0%}" for b in r["gpu_busy"])
        print(f"{eta:>4} {r['steps']:>6} {r['tokens']:>8.0f} {r['wall_s']:>7.1f} {r['step_s']:>7.2f} "
              f"{r['train_s']:>8.2f} {r['tok_s']:>14.0f} {r['trainer_idle']:>13.0%}{busy}")
    etas = list(results)
    if len(etas) >= 2:
        print(f"eta={etas[-1]} / eta={etas[0]}: {results[etas[-1]]['tok_s'] / results[etas[0]]['tok_s']:.2f}x "
              f"trained tokens/s")


if __name__ == "__main__":
    main()
