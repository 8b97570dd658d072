"""End to end through the launcher: 2 embedded servers, 1 worker, the queue, a 2-rank trainer.

Tiny random Llama from the fixture, η = 1, 3 steps. Everything crosses real process boundaries:
HTTP to the servers, TCP to the queue, gloo for the trainer ranks and the weight broadcast.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support import REPO


@pytest.fixture(scope="module")
def e2e_run(tiny_model_dir, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("runs")
    overrides = [
        "name=e2e", f"run_root={run_root}", "seed=3",
        f"model.path={tiny_model_dir}", "model.dtype=float32",
        "data.max_prompt_len=400",
        "inference.num_servers=2",
        "inference.max_seq_len=512", "inference.threads=1", "inference.max_running_requests=8",
        "rollout.num_workers=1", "rollout.n_samples=2", "rollout.max_new_tokens=12",
        "queue.batch_size=2", "queue.max_staleness=1", "queue.max_concurrent=4",
        "trainer.nproc=2", "trainer.total_steps=3", "trainer.lr=1e-3",  # ports: 0, chosen by the launcher
        # evaluations long enough to overlap a step: without the wait before the next weight send
        # this run fails with MixedVersionError (tokens of versions [1, 2] in the evaluation of 1)
        "eval.num_prompts=8", "eval.max_new_tokens=48", "eval.every_steps=1",
        # Mixed rewards from a random model, and no weight decay: parameters move only through
        # policy-gradient updates.
        "reward.fn=tests.support.parity_reward:even_length", "trainer.weight_decay=0",
        "logging.wandb_mode=offline",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.local", "configs/gsm8k_smollm2.yaml", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    return proc, run_root / "e2e"


def test_job_exits_zero(e2e_run):
    proc, run_dir = e2e_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "config.yaml").exists()
    assert list((run_dir / "wandb").rglob("*.wandb")), "no offline wandb run was written"


def test_versions_staleness_and_accounting(e2e_run):
    proc, run_dir = e2e_run
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert [r["version/trainer"] for r in steps] == [1, 2, 3]
    assert steps[-1]["version/servers"] == 3
    assert all(r["staleness/max"] <= 1 for r in steps)
    assert any(0 < r["rollout/correct"] < 1 for r in steps), "rewards were never mixed"
    assert any(r["train/grad_norm"] > 0 for r in steps)
    elapsed = [r["perf/elapsed_s"] for r in steps]  # training wall time: the x-axis for wall-time panels
    assert 0 < elapsed[0] < elapsed[1] < elapsed[2] <= steps[-1]["time"] - rows[0]["time"] + elapsed[0] + 1.0
    acct = json.loads((run_dir / "queue_accounting.json").read_text())
    assert acct["consumed"] == 3 * 2
    assert acct["leased"] == acct["consumed"] + acct["ready"] + acct["running"] + acct["rejected"]
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[-1]


def test_evaluations_every_step_each_of_one_version(e2e_run):
    # eval.every_steps=1: at the start (version 0), after steps 0 and 1 (versions 1, 2, overlapping
    # the next step) and at the end (3, covering every_steps' own at 3); each logged at the step
    # of its version, and every token of it came from that version (evaluate raises otherwise)
    proc, run_dir = e2e_run
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [(r["step"], r["eval/version"]) for r in evals] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert all("perf/eval_wait_s" in r for r in steps.values())


def test_parameters_changed(e2e_run, tiny_model_dir):
    proc, run_dir = e2e_run
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert len(changed) == len(before), f"unchanged tensors: {set(before) - set(changed)}"
