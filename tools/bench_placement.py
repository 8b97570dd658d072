"""Synchronous (η = 0) vs asynchronous (η = 1) step time under each CPU placement, one config.

    python tools/bench_placement.py configs/quickstart_cpu.yaml [--placements none split] \
        [--staleness 0 1] [--steps N] [--no-eval] [--json FILE] [override ...]

Runs ``python -m launcher.local CONFIG [overrides] <placement's keys> name=<config name>_<placement>
_eta<η> queue.max_staleness=<η> [trainer.total_steps=N] --overwrite`` for each placement and η, one
after the other (the machine should run nothing else meanwhile), and reads each run's
``metrics.jsonl``. Placements, over the CPUs this process may use (``os.sched_getaffinity``; the
first half and the second half, e.g. 0 and 1 on 2 cores):

- ``none``: nothing pinned, fixed threads (``cpu_threads=fixed``);
- ``split``: the servers on the first half, the trainer on the second; queue and workers float;
- ``split-light``: as ``split``, the queue and the workers on the servers' half too;
- ``adaptive``: nothing pinned, ``cpu_threads=adaptive`` (threads follow who computes).

Printed: the CPU (model, count, the vector flags), then one row per run: steps, **Σ step s** (Σ
``perf/step_s``: taking the batch, training, publishing the weights; no evaluation, no
checkpoint), **elapsed s** (the launcher's wall time, start-up and evaluation included) and, per
placement, the speed-up of the last η over the first on each (first / last). ``--no-eval`` turns
evaluation off (``eval.at_start=false eval.at_end=false eval.every_steps=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_async.cpus import format_list  # noqa: E402

NO_EVAL = ["eval.at_start=false", "eval.at_end=false", "eval.every_steps=0"]
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_bf16", "amx_int8")


def placements(allowed: list[int]) -> dict[str, list[str]]:
    """Each placement's overrides over the CPUs ``allowed`` (module docstring)."""
    half = len(allowed) // 2
    servers, trainer = format_list(allowed[:half]), format_list(allowed[half:])
    split = [f'inference.cpus="{servers}"', f'trainer.cpus="{trainer}"']
    return {"none": ["cpu_threads=fixed"], "split": ["cpu_threads=fixed", *split],
            "split-light": ["cpu_threads=fixed", *split, f'queue.cpus="{servers}"', f'rollout.cpus="{servers}"'],
            "adaptive": ["cpu_threads=adaptive"]}


def cpu_description() -> str:
    """The CPU's model, count and vector flags, from ``/proc/cpuinfo``."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    allowed = format_list(os.sched_getaffinity(0))
    shown = " ".join(f for f in VECTOR_FLAGS if f in flags) or "none of the vector flags"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"CPU: {model}; {os.cpu_count()} CPU(s), this process may use {allowed}; flags: {shown}; "
            f"load average at start: {load}")


def summarize(run_dir: pathlib.Path) -> dict:
    """Steps and Σ ``perf/step_s`` of a finished run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "perf/step_s" in r]
    return {"steps": len(steps), "step_s": sum(r["perf/step_s"] for r in steps),
            "train_s": sum(r.get("perf/train_s", 0.0) for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--placements", nargs="+", default=["none", "split"], help="of: none split split-light adaptive")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=0, help="trainer.total_steps (0: the config's)")
    ap.add_argument("--no-eval", action="store_true", help="turn evaluation off")
    ap.add_argument("--timeout-s", type=float, default=7200)
    ap.add_argument("--json", default="")
    args = ap.parse_intermixed_args()  # flags before, between or after the overrides

    from areal_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    known = placements(sorted(os.sched_getaffinity(0)))
    unknown = [p for p in args.placements if p not in known]
    if unknown:
        ap.error(f"--placements {' '.join(unknown)}: choose among {' '.join(known)}")
    if len(os.sched_getaffinity(0)) < 2 and set(args.placements) - {"none", "adaptive"}:
        ap.error("split placements need 2 CPUs or more; give --placements none")
    cpu = cpu_description()
    print(cpu, flush=True)
    extra = ([f"trainer.total_steps={args.steps}"] if args.steps else []) + (NO_EVAL if args.no_eval else [])
    results: list[dict] = []
    for placement in args.placements:
        for eta in args.staleness:
            name = f"{cfg.name}_{placement}_eta{eta}"
            # the run's name, η and placement come last, so they win over the same keys in ``overrides``
            cmd = [sys.executable, "-m", "launcher.local", args.config, *args.overrides, *extra, *known[placement],
                   f"name={name}", f"queue.max_staleness={eta}", "--overwrite"]
            print("+", " ".join(cmd), flush=True)
            start = time.monotonic()
            subprocess.run(cmd, cwd=REPO, check=True, timeout=args.timeout_s)
            res = {"placement": placement, "eta": eta, "elapsed_s": time.monotonic() - start,
                   **summarize(REPO / cfg.run_root / name)}
            results.append(res)
            print(json.dumps(res), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"cpu": cpu, "argv": sys.argv, "runs": results}, indent=1))

    print(f"\n{cpu}\n{args.config} {' '.join(args.overrides + extra)}")
    for placement in args.placements:
        print(f"  {placement}: {' '.join(known[placement]) or '(nothing pinned)'}")
    print(f"{'placement':<12} {'eta':>4} {'steps':>6} {'Σ step s':>9} {'Σ train s':>10} {'elapsed s':>10}")
    for r in results:
        print(f"{r['placement']:<12} {r['eta']:>4} {r['steps']:>6} {r['step_s']:>9.1f} {r['train_s']:>10.1f} "
              f"{r['elapsed_s']:>10.1f}")
    first, last = args.staleness[0], args.staleness[-1]
    if first != last:
        for placement in args.placements:
            by_eta = {r["eta"]: r for r in results if r["placement"] == placement}
            a, b = by_eta[first], by_eta[last]
            print(f"{placement}: eta={last} vs eta={first}: {a['step_s'] / b['step_s']:.2f}x in Σ step s, "
                  f"{a['elapsed_s'] / b['elapsed_s']:.2f}x in elapsed")


if __name__ == "__main__":
    main()
