"""``rollout.env_timeout_s``: an ``Env`` call that never returns fails the worker with the env,
method, episode and turn named. An ``async`` call raises ``EnvTimeout``; a synchronous one, which
blocks the event loop, ends the process (run here in a subprocess). Episodes:
``tests/support/env_timeout.py``.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from areal_async.rollout.env_limit import EnvTimeout
from tests.support.env_timeout import run_episode

ROOT = pathlib.Path(__file__).resolve().parents[1]


class HangingEnv:
    """Turn 0 answers; turn 1 awaits what never comes."""

    def reset(self, item, seed):
        return None

    async def step(self, action):
        if action.turn == 1:
            await asyncio.Event().wait()
        return [{"role": "user", "content": "more"}], 0.0, False


class SlowEnv:
    """One synchronous step of 0.5 s, then done."""

    def reset(self, item, seed):
        return None

    def step(self, action):
        time.sleep(0.5)
        return None, 1.0, True


def test_an_async_step_that_never_returns_fails_the_episode_with_its_env_episode_and_turn(tiny_model_dir):
    # it stalled the job: the trainer waited for the group forever, nothing named the env
    t0 = time.monotonic()
    with pytest.raises(EnvTimeout, match=r"HangingEnv\.step has run [\d.]+ s in episode g3-s1, turn 1 "
                                         r"\(rollout\.env_timeout_s=0\.3\); .* raise rollout\.env_timeout_s"):
        run_episode(tiny_model_dir, HangingEnv, 0.3, bound_s=3.0)
    assert time.monotonic() - t0 < 1.5


def test_a_step_that_blocks_the_event_loop_ends_the_process_naming_it(tiny_model_dir):
    # asyncio cannot interrupt it, sync or inside an async step: the watchdog thread ends the
    # process with the message on stderr (both run at once, each in its own process)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {name: subprocess.Popen([sys.executable, "-m", "tests.support.env_timeout", str(tiny_model_dir), name],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for name in ("BlockingEnv", "BlockingAsyncEnv")}
    for name, proc in procs.items():
        try:  # generous: starting torch and the tiny engine takes tens of seconds on a loaded machine
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the process of {name} was still running after 120 s")
        assert proc.returncode == 1, stderr
        last = stderr.strip().splitlines()[-1:]
        found = last and re.fullmatch(
            rf"\[env-watchdog\] {name}\.step has run ([\d.]+) s in episode g3-s1, turn 1 "
            r"\(rollout\.env_timeout_s=0\.3\); .*raise rollout\.env_timeout_s.*", last[0])
        assert found, stderr
        assert float(found.group(1)) < 10, stderr  # ended soon after the limit, not by the process's end


def test_env_timeout_0_leaves_a_slow_step_alone(tiny_model_dir):
    sample = run_episode(tiny_model_dir, SlowEnv, 0.0)
    assert sample.turn_rewards.tolist() == [1.0]


def test_a_step_within_the_limit_is_not_interrupted(tiny_model_dir):
    sample = run_episode(tiny_model_dir, SlowEnv, 2.0)
    assert sample.turn_rewards.tolist() == [1.0]
