"""The determinism proof on one GPU, and what deterministic mode costs there.

    python tools/gpu_determinism.py [--steps 4] [--batch-size 8] [--n-samples 4] [--new-tokens 128]
        [--jitter-ms 10] [--model-path /tmp/qwen3-0.6b-random] [--run-root runs/gpu_determinism]
        [--weight-sync disk] [--modes deterministic throughput] [--reuse] [--timeout-s 400] [--json F]
    python tools/gpu_determinism.py --device cpu --steps 2 --batch-size 2 --n-samples 2 --new-tokens 12

Four jobs through ``python -m launcher.local configs/async_vs_sync_gpu.yaml <overrides> --overwrite``,
one after the other: ``mode`` deterministic and throughput, each with ``debug.jitter_seed`` 1 and 2
(same ``debug.jitter_ms``). Each job: one embedded server (``cuda:0``), the replay queue, 2
generation workers, a 1-rank trainer (``cuda``), η = 1, bf16 server and trainer compute (fp32 on
CPU), the ``arith`` task without few-shot demonstrations, reward ``tests.support.parity_reward:even_length``
(mixed rewards from random weights), no eval, an eager trainer (``trainer.compile=false`` in both
modes: deterministic mode refuses compilation). If ``--model-path`` does not exist, a random Qwen3-0.6B-
shaped model (``tiny`` with ``--device cpu``) is written there first (``tools/qwen3_shapes.py``).

Each pair of seeds is compared as ``tests/test_determinism.py`` does: every ``metrics.jsonl`` row
without wall-clock and queue-snapshot keys, ``trajectories.jsonl`` (counted per group), and the
SHA-256 of the final weights. Deterministic runs must be identical; throughput runs should differ.
Cost: median ``perf/step_s`` (and ``perf/train_s``, the trainer's share) of the deterministic runs
over the throughput runs, both under the same jitter. ``--weight-sync disk`` is the default because
NCCL refuses a group of two processes on one GPU ("Duplicate GPU detected": trainer and server).
The defaults took ~8 minutes on one H200; ``--modes`` and ``--reuse`` (a finished job of the same
settings in ``--run-root`` is read, not run again) split the jobs over invocations. Exit 1 if any
job failed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from areal_async.trainer.checkpoint import state_dict_sha256  # noqa: E402

SEEDS = (1, 2)
MAX_PROMPT_LEN = 256  # arith prompts without few-shot are ~125 tokens with the random model's tokenizer
LR = 1e-3  # large enough that every update changes the servers' bf16 weights
# Wall-clock timings and queue snapshots: observations of timing, not results (tests/test_determinism.py).
TIMING_KEYS = {"time", "rollout/tokens_per_s", "queue/ready", "queue/running", "queue/capacity"}


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    ports = [s.bind(("127.0.0.1", 0)) or s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def overrides(args, mode: str, seed: int) -> list[str]:
    """The job's settings (ports excluded: they change from run to run)."""
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    b, n = args.batch_size, args.n_samples
    return [
        f"name={mode}-{seed}", f"run_root={args.run_root}", "seed=3", f"mode={mode}",
        f"model.path={args.model_path}", f"model.dtype={dtype}",
        "data.task=arith", "data.few_shot=0", f"data.max_prompt_len={MAX_PROMPT_LEN}",
        "inference.num_servers=1", f"inference.device={'cuda:0' if cuda else 'cpu'}",
        f"inference.max_seq_len={MAX_PROMPT_LEN + args.new_tokens}", f"inference.threads={0 if cuda else 1}",
        f"inference.max_running_requests={2 * b * n}",  # η + 1 = 2 batches of requests in flight at most
        "rollout.num_workers=2", f"rollout.n_samples={n}", f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.max_groups_in_flight={b}",
        f"queue.batch_size={b}", "queue.max_staleness=1", f"queue.max_concurrent={2 * b}",
        "trainer.nproc=1", f"trainer.device={args.device}", f"trainer.dtype={dtype}",
        f"trainer.total_steps={args.steps}", f"trainer.lr={LR}", "trainer.weight_decay=0",
        "trainer.max_tokens_per_mb=16384", f"trainer.weight_sync={args.weight_sync}",
        # eager in both modes: deterministic mode refuses trainer.compile (the config compiles),
        # and the cost compares the same kernels less their batch invariance
        "trainer.compile=false",
        "reward.fn=tests.support.parity_reward:even_length",
        "eval.at_start=false", "eval.at_end=false", f"eval.max_new_tokens={args.new_tokens}",
        "logging.wandb_mode=disabled", "logging.dump_trajectories=true",
        f"debug.jitter_ms={args.jitter_ms}", f"debug.jitter_seed={seed}",
    ]


def run_job(args, mode: str, seed: int) -> dict:
    """Run (or, with ``--reuse``, read back) one job; returns its fingerprint and timings, or
    ``{"failed": reason}`` after printing the end of its output."""
    settings = overrides(args, mode, seed)
    run_dir = pathlib.Path(args.run_root) / f"{mode}-{seed}"
    stamp = run_dir / "gpu_determinism.json"  # written only after a successful run
    if args.reuse and stamp.exists() and json.loads(stamp.read_text())["overrides"] == settings:
        print(f"[{mode}-{seed}] reusing the finished run in {run_dir}", flush=True)
        return summarize(run_dir, json.loads(stamp.read_text())["wall_s"])
    server, queue, master, sync = free_ports(4)
    cmd = [sys.executable, "-m", "launcher.local", "configs/async_vs_sync_gpu.yaml", *settings,
           f"inference.base_port={server}", f"queue.port={queue}", f"trainer.master_port={master}",
           f"trainer.weight_sync_port={sync}", "--overwrite"]
    print(f"[{mode}-{seed}] {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=args.timeout_s)[0]
        failed = f"exit {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops every process of the job on SIGTERM
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        failed = f"timed out after {args.timeout_s:.0f} s"
    wall_s = time.monotonic() - start
    if not failed:
        try:
            result = summarize(run_dir, wall_s)
            assert result["steps"] == args.steps, f"{result['steps']} steps logged, expected {args.steps}"
        except (OSError, ValueError, AssertionError) as exc:
            failed = f"unreadable results: {exc!r}"
    if failed:
        print(f"[{mode}-{seed}] FAILED ({failed}); last 3000 characters of its output:\n{out[-3000:]}", flush=True)
        return {"failed": failed, "wall_s": wall_s}
    stamp.write_text(json.dumps({"overrides": settings, "wall_s": wall_s}))
    print(f"[{mode}-{seed}] done in {wall_s:.0f} s: weights {result['weights'][:16]}, "
          f"median step {result['median_step_s']:.2f} s, "
          f"largest grad norm {result['max_grad_norm']:.3g}", flush=True)
    return result


def summarize(run_dir: pathlib.Path, wall_s: float) -> dict:
    from safetensors.torch import load_file

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r]
    tok_s = [r["rollout/tokens_per_s"] for r in steps if "rollout/tokens_per_s" in r]
    return {
        "metrics": [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("perf/")}
                    for r in rows],
        "trajectories": (run_dir / "trajectories.jsonl").read_text().splitlines(),
        "weights": state_dict_sha256(load_file(str(run_dir / "checkpoint" / "model.safetensors"))),
        "steps": len(steps), "wall_s": wall_s,
        "max_grad_norm": max(r.get("train/grad_norm", 0.0) for r in steps),
        "median_step_s": statistics.median(r["perf/step_s"] for r in steps),
        "median_train_s": statistics.median(r.get("perf/train_s", 0.0) for r in steps),
        "mean_rollout_tokens_per_s": statistics.fmean(tok_s) if tok_s else None,
    }


def compare(a: dict, b: dict) -> dict:
    """Where two runs' fingerprints differ: the first metrics row and key, the number of
    differing trajectory groups, the two weight hashes."""
    first = None
    for i, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"])):
        keys = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
        if keys:
            first = {"step": ra.get("step", i), "key": keys[0], "a": ra.get(keys[0]), "b": rb.get(keys[0]),
                     "keys": len(keys)}
            break
    if first is None and len(a["metrics"]) != len(b["metrics"]):
        first = {"step": min(len(a["metrics"]), len(b["metrics"])), "key": "(row count)"}
    ga, gb = ([g for x in t for g in json.loads(x)["groups"]] for t in (a["trajectories"], b["trajectories"]))
    groups_diff = sum(x != y for x, y in zip(ga, gb)) + abs(len(ga) - len(gb))
    return {"identical": first is None and groups_diff == 0 and a["trajectories"] == b["trajectories"]
            and a["weights"] == b["weights"], "first_metric_diff": first, "groups_differing": groups_diff,
            "groups": max(len(ga), len(gb)), "weights": [a["weights"], b["weights"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="groups per step (queue.batch_size)")
    ap.add_argument("--n-samples", type=int, default=4, help="samples per group (rollout.n_samples)")
    ap.add_argument("--new-tokens", type=int, default=128, help="rollout.max_new_tokens")
    ap.add_argument("--jitter-ms", type=float, default=10.0, help="debug.jitter_ms of every run")
    ap.add_argument("--model-path", default="", help="default /tmp/qwen3-0.6b-random (cpu: qwen3-tiny-random)")
    ap.add_argument("--run-root", default="runs/gpu_determinism")
    ap.add_argument("--weight-sync", choices=["disk", "distributed"], default="disk")
    ap.add_argument("--modes", nargs="+", choices=["deterministic", "throughput"],
                    default=["deterministic", "throughput"])
    ap.add_argument("--reuse", action="store_true", help="read finished runs of the same settings")
    ap.add_argument("--timeout-s", type=float, default=400.0, help="per run")
    ap.add_argument("--json", default="", help="write every number here")
    args = ap.parse_args()
    shape = "0.6b" if args.device == "cuda" else "tiny"
    args.model_path = str(pathlib.Path(args.model_path or f"/tmp/qwen3-{shape}-random").resolve())
    args.run_root = str(pathlib.Path(args.run_root).resolve())

    if not pathlib.Path(args.model_path).exists():
        import torch
        from qwen3_shapes import write_model_dir

        print(f"writing a random {shape} model to {args.model_path}", flush=True)
        write_model_dir(shape, args.model_path, torch.bfloat16 if args.device == "cuda" else torch.float32)

    runs = {(mode, seed): run_job(args, mode, seed) for mode in args.modes for seed in SEEDS}
    ok = {key: r for key, r in runs.items() if "failed" not in r}
    pairs = {mode: compare(ok[mode, 1], ok[mode, 2]) for mode in args.modes if (mode, 1) in ok and (mode, 2) in ok}
    for mode, c in pairs.items():
        print(f"\n{mode}: {'identical' if c['identical'] else 'DIFFERENT'}; first differing metric: "
              f"{c['first_metric_diff']}; trajectory groups differing: {c['groups_differing']} of "
              f"{c['groups']}; weights {c['weights'][0]} vs {c['weights'][1]}")

    def pooled(mode: str, key: str) -> float | None:
        values = [ok[mode, s][key] for s in SEEDS if (mode, s) in ok and ok[mode, s][key] is not None]
        return statistics.median(values) if values else None

    step_det, step_thr = pooled("deterministic", "median_step_s"), pooled("throughput", "median_step_s")
    tok_det, tok_thr = (pooled(m, "mean_rollout_tokens_per_s") for m in ("deterministic", "throughput"))
    slowdown = step_det / step_thr if step_det and step_thr else None
    tok_slowdown = tok_thr / tok_det if tok_det and tok_thr else None

    print(f"\n{args.device}, model {args.model_path}: {args.batch_size} groups x {args.n_samples} samples x "
          f"{args.new_tokens} new tokens per step, jitter {args.jitter_ms:g} ms, weight sync {args.weight_sync}\n")
    print("| mode | jitter seed | steps | weights SHA-256 | median step s | median train s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for (mode, seed), r in runs.items():
        if "failed" in r:
            print(f"| {mode} | {seed} | FAILED: {r['failed']} | | | | {r['wall_s']:.0f} |")
        else:
            print(f"| {mode} | {seed} | {r['steps']} | {r['weights'][:16]} | {r['median_step_s']:.2f} "
                  f"| {r['median_train_s']:.2f} | {r['wall_s']:.0f} |")
    trained = sum(r["max_grad_norm"] > 0 for r in ok.values())
    print(f"\nruns with a non-zero gradient (weights moved): {trained} of {len(ok)}")
    for mode in args.modes:
        verdict = ("yes" if pairs[mode]["identical"] else "no") if mode in pairs else "not compared (a run failed)"
        print(f"{mode} runs identical: {verdict}")
    print(f"slowdown: {f'{slowdown:.2f}×' if slowdown else 'n/a'} (median perf/step_s, deterministic / "
          f"throughput, same jitter in both)")
    if tok_slowdown:
        print(f"rollout/tokens_per_s (a batch's output tokens / its step's wall time): {tok_thr:.0f} "
              f"throughput vs {tok_det:.0f} deterministic ({tok_slowdown:.2f}×)")
    if args.json:
        dump = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
                "runs": {f"{m}-{s}": {k: v for k, v in r.items() if k not in ("metrics", "trajectories")}
                         for (m, s), r in runs.items()},
                "pairs": pairs, "slowdown_step_s": slowdown, "slowdown_rollout_tokens_per_s": tok_slowdown}
        pathlib.Path(args.json).write_text(json.dumps(dump, indent=1))
    return 1 if len(ok) < len(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
