"""The determinism proof for multi-turn episodes, end to end through the launcher.

The job of ``tests/test_determinism.py`` (timing jitter on; one worker, one trainer rank; 3 steps,
2 in throughput mode) with episodes of ``tests.support.episode_envs:ThreeTurnToolEnv``: 3 model turns, a real calculator and
python tool run between them, per-turn rewards; η = 2. Two ``mode: deterministic`` runs with different jitter
seeds, the second with its only worker SIGKILLed while it holds groups, must give identical
metrics (timing keys and fault counters excluded), trajectories and final weights; the same pair
in ``mode: throughput`` must differ, which shows the comparison can fail.
"""

import json
import os
import signal

import pytest

from tests.support.chaos import CHAOS_TOKEN, FAULT_KEYS, holding, pids, start_chaos_job, wait
from tests.support.jobs import JobRuns, fingerprint, stop_and_read

# one worker and one trainer rank (several of each: tests/test_determinism.py): a shorter suite
# reward.fn="": the environment scores its own turns (the jobs' parity reward would be refused beside it)
EPISODES = ("rollout.workflow=tests.support.episode_envs:ThreeTurnToolEnv", 'reward.fn=""', "rollout.max_turns=3",
            "queue.max_staleness=2", "rollout.max_new_tokens=8", "rollout.num_workers=1", "trainer.nproc=1")
# 3 steps: staleness reaches η = 2 at step 2; throughput runs differ after 2 (fewer: a shorter suite)
STEPS = {"deterministic": 3, "throughput": 2}


def _compared(fp: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in fp["metrics"]]


@pytest.fixture(scope="module")
def episode_runs(tiny_model_dir, tmp_path_factory):
    """``episode_runs[mode, jitter_seed]``: the fingerprint of that undisturbed job, run on first use."""
    runs = JobRuns(tiny_model_dir, tmp_path_factory.mktemp("episode-runs"), STEPS, EPISODES)
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def killed_episode_run(tiny_model_dir, tmp_path_factory, episode_runs):
    """A deterministic episode job (jitter seed 2, one worker) whose worker is SIGKILLed while it
    holds groups, after step 0 was logged; returns (exit status, the launcher's output, run directory).
    The undisturbed run it is compared with runs alongside."""
    from areal_async.config import load_config

    episode_runs.start(("deterministic", 1))
    _, run_dir, out, proc = start_chaos_job(tiny_model_dir, tmp_path_factory.mktemp("episode-killed"),
                                            "killed-worker", EPISODES, jitter_seed=2,
                                            steps=STEPS["deterministic"])
    try:
        queue = load_config(run_dir / "config.yaml").queue
        wait("a running group", lambda: holding(queue, 1, CHAOS_TOKEN), 90, proc)
        [pid] = pids(run_dir / "config.yaml")
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        output = stop_and_read(proc, out)
    return proc.returncode, output, run_dir


def test_deterministic_episode_runs_are_bitwise_identical_under_jitter_and_a_killed_worker(
        episode_runs, killed_episode_run):
    rc, output, run_dir = killed_episode_run
    assert rc == 0, output[-4000:]
    assert "worker0 was killed by SIGKILL; restart 1 of 3" in output
    acct = json.loads((run_dir / "queue_accounting.json").read_text())
    assert acct["released"] >= 1 and acct["worker_restarts"] == 1, "the worker held no group when killed"

    a, b = episode_runs["deterministic", 1], fingerprint(run_dir)
    print(f"\nepisode weights sha256: {a['weights']} / {b['weights']}; "
          f"staleness/max: {[r['staleness/max'] for r in a['metrics']]}")
    steps = STEPS["deterministic"]
    assert len(a["trajectories"]) == steps and [r["step"] for r in a["metrics"]] == list(range(steps))
    assert all(r["rollout/turns"] == 3 for r in a["metrics"])
    assert all(r["rollout/tool_calls"] == 2 and r["rollout/tool_errors"] == 0 for r in a["metrics"])
    assert all(r["staleness/max"] <= 2 for r in a["metrics"]) and a["metrics"][-1]["staleness/max"] == 2
    assert b["metrics"][-1]["rollout/worker_restarts"] == 1

    samples = [s for line in a["trajectories"] for g in json.loads(line)["groups"] for s in g["samples"]]
    rewards = [r for s in samples for r in s["turn_rewards"]]
    assert 0 < sum(rewards) < len(rewards), "turn rewards were never mixed"
    for s in samples:
        spans, mask = s["turn_spans"], s["loss_mask"]
        assert len(spans) == 3 and len(s["turn_rewards"]) == 3
        assert spans[-1][1] == len(mask) == len(s["output_ids"])
        for (start, end), (after, _) in zip(spans, spans[1:]):
            assert all(mask[start:end]) and after > end and not any(mask[end:after]), "no tool tokens between turns"

    for step, (ra, rb) in enumerate(zip(_compared(a), _compared(b), strict=True)):
        assert ra == rb, f"metrics of step {step} differ: " + str(
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)})
    for step, (ta, tb) in enumerate(zip(a["trajectories"], b["trajectories"], strict=True)):
        assert ta == tb, f"trajectories of step {step} differ"
    assert a["weights"] == b["weights"]


def test_throughput_episode_runs_differ_under_jitter(episode_runs):
    episode_runs.start(("throughput", 1), ("throughput", 2))  # side by side
    a, b = episode_runs["throughput", 1], episode_runs["throughput", 2]
    differ = {key: a[key] != b[key] for key in ("metrics", "trajectories", "weights")}
    print(f"\nthroughput episode weights sha256: {a['weights']} / {b['weights']}; differ: {differ}")
    assert differ["trajectories"] and differ["weights"]
