"""The determinism proof, end to end through the launcher (docs/design.md, "Determinism").

Two runs of ``mode: deterministic`` (η = 1, 2 embedded servers, 2 workers, a 2-rank trainer, the
tiny fixture model) with random timing jitter in workers, servers, queue and trainer, seeded
differently (``debug.jitter_seed`` 1 and 2), must give identical per-step metrics (wall-clock
and queue-snapshot numbers excluded, see ``TIMING_KEYS``), identical trajectories (the trainer's
``trajectories.jsonl``) and identical final weights (SHA-256 over the state dict). The same pair of
runs in ``mode: throughput`` must differ, which shows the comparison can fail.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from areal_async.trainer.checkpoint import state_dict_sha256

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4
# Wall-clock timings, and snapshots of the queue taken while workers race on (how many groups
# happen to be ready/running at the moment of logging): observations of timing, not results.
TIMING_KEYS = {"time", "rollout/tokens_per_s", "queue/ready", "queue/running", "queue/capacity"}


def run_job(model_dir: pathlib.Path, run_root: pathlib.Path, name: str, mode: str, jitter_seed: int,
            steps: int = STEPS, resume: bool = False, jitter_ms: float = 20,
            extra: tuple[str, ...] = ()) -> pathlib.Path:
    """Run one job of ``steps`` steps through ``launcher.local`` (``resume``: continue the run
    ``name`` from its checkpoint; ``extra``: more overrides); returns its run directory (asserts
    exit 0)."""
    overrides = [
        f"name={name}", f"run_root={run_root}", "seed=3", f"mode={mode}",
        f"model.path={model_dir}", "model.dtype=float32", "data.max_prompt_len=400",
        "inference.num_servers=2",
        "inference.max_seq_len=512", "inference.threads=1", "inference.max_running_requests=8",
        "rollout.num_workers=2", "rollout.n_samples=4", "rollout.max_new_tokens=12",
        "rollout.max_groups_in_flight=2",
        "queue.batch_size=2", "queue.max_staleness=1", "queue.max_concurrent=4",
        "trainer.nproc=2", f"trainer.total_steps={steps}", "trainer.lr=1e-3", "trainer.weight_decay=0",
        "eval.at_start=false", "eval.at_end=false", "eval.max_new_tokens=8",
        "reward.fn=tests.parity_reward:even_length",
        "logging.wandb_mode=disabled", "logging.dump_trajectories=true",
        f"debug.jitter_ms={jitter_ms}", f"debug.jitter_seed={jitter_seed}", *extra,
    ]
    flags = ["--resume"] if resume else []
    proc = subprocess.run([sys.executable, "-m", "launcher.local", "configs/gsm8k_smollm2.yaml", *overrides, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_root / name


def fingerprint(run_dir: pathlib.Path) -> dict:
    """What must be identical across deterministic runs: metrics, trajectories, weights."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("perf/")} for r in rows]
    trajectories = (run_dir / "trajectories.jsonl").read_text().splitlines()
    weights = state_dict_sha256(load_file(str(run_dir / "checkpoint" / "model.safetensors")))
    return {"metrics": metrics, "trajectories": trajectories, "weights": weights}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("det-runs")
    return {(mode, seed): fingerprint(run_job(tiny_model_dir, root, f"{mode}-{seed}", mode, seed))
            for mode in ("deterministic", "throughput") for seed in (1, 2)}


def test_deterministic_runs_are_bitwise_identical_under_jitter(runs):
    a, b = runs["deterministic", 1], runs["deterministic", 2]
    print(f"\ndeterministic weights sha256: {a['weights']} / {b['weights']}")
    assert len(a["trajectories"]) == STEPS and [r["step"] for r in a["metrics"]] == list(range(STEPS))
    assert any(0 < r["rollout/correct"] < 1 for r in a["metrics"]), "rewards were never mixed"
    assert all(r["staleness/max"] <= 1 for r in a["metrics"])
    for step, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"])):
        assert ra == rb, f"metrics of step {step} differ: " + str(
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)})
    for step, (ta, tb) in enumerate(zip(a["trajectories"], b["trajectories"])):
        assert ta == tb, f"trajectories of step {step} differ"
    assert a["weights"] == b["weights"]


def test_throughput_runs_differ_under_jitter(runs):
    a, b = runs["throughput", 1], runs["throughput", 2]
    differ = {key: a[key] != b[key] for key in ("metrics", "trajectories", "weights")}
    print(f"\nthroughput weights sha256: {a['weights']} / {b['weights']}; differ: {differ}")
    assert differ["trajectories"] and differ["weights"]
