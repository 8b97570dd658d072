"""``rollout.env_timeout_s``: an ``Env`` call that never returns fails the worker with the env,
method, episode and turn named. An ``async`` call raises ``EnvTimeout``; a synchronous one, which
blocks the event loop, ends the process (run here in a subprocess). Episodes:
``tests/support/env_timeout.py``. An agent's ``run`` is limited in its own time: the time with one
of its model calls in flight does not count (a scripted client, ``tests/support/scripted.py``).
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

from areal_async.rollout.env_limit import EnvTimeout, ModelClock, call_env
from areal_async.rollout.workflows import OpenAIWorkflow
from tests.support.env_timeout import run_episode
from tests.support.scripted import run_workflow, scripted_episode

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


async def three_calls(item, client):
    messages = list(item.messages)
    for _ in range(3):
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    return 1.0


async def works_between_calls(item, client):
    await asyncio.sleep(0.2)  # its own work: a tool, a sandbox
    await client.chat.completions.create(model="p", messages=item.messages)
    await asyncio.sleep(0.2)
    return 1.0


def test_an_agents_slow_model_calls_do_not_count_against_its_limit(tok):
    # 0.9 s of generation (a shared engine, a weight update's pause) failed an innocent run at 0.3 s
    t0 = time.monotonic()
    sample = run_workflow(OpenAIWorkflow(three_calls, 1.0, 1.0, env_timeout_s=0.3), scripted_episode(tok, delay_s=0.3))
    assert sample.reward == 1.0 and sample.stats.turns == 3 and not sample.stats.env_error
    assert time.monotonic() - t0 >= 0.9


def test_an_agent_past_the_limit_in_its_own_code_is_cut_naming_its_model_time(tok):
    # 0.4 s of its own around a 0.3 s call: cut once its own time reaches 0.3 s, not at 0.3 s of wall time
    t0 = time.monotonic()
    with pytest.raises(EnvTimeout, match=r"works_between_calls\(item, client\) has run [\d.]+ s in episode g0-s2 "
                                         r"\(rollout\.env_timeout_s=0\.3\); [\d.]+ s of it with a model call in "
                                         r"flight, which the limit does not count; .*raise rollout\.env_timeout_s"):
        run_workflow(OpenAIWorkflow(works_between_calls, 1.0, 1.0, env_timeout_s=0.3),
                     scripted_episode(tok, delay_s=0.3))
    assert 0.6 <= time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("own_s, cut", [(0.15, False), (0.45, True)])
def test_overlapping_model_calls_count_once(own_s, cut):
    # calls in flight over 0-0.6 s and 0.1-0.7 s: 0.7 s not counted, not 1.2 s
    clock = ModelClock()

    async def generate(after_s):
        await asyncio.sleep(after_s)
        with clock.call():
            await asyncio.sleep(0.6)

    async def run(item, client):
        await asyncio.gather(generate(0.0), generate(0.1))
        await asyncio.sleep(own_s)
        return 1.0

    async def main():
        return await call_env(run, (None, None), "run(item, client)", "episode g0-s2", 0.3, clock)

    if cut:
        with pytest.raises(EnvTimeout, match=r"run\(item, client\) has run [\d.]+ s in episode g0-s2 "
                                             r"\(rollout\.env_timeout_s=0\.3\); 0\.7 s of it with a model call"):
            asyncio.run(main())
    else:
        assert asyncio.run(main()) == 1.0
    assert 0.0 <= clock.busy_s() - 0.7 < 0.1


BLOCKS_WITH_A_CALL_IN_FLIGHT = """
import asyncio, time
from areal_async.rollout.env_limit import ModelClock, call_env

clock = ModelClock()

async def generate():
    with clock.call():
        await asyncio.sleep(60)

async def run(item, client):
    asyncio.ensure_future(generate())
    await asyncio.sleep(0.05)
    time.sleep(60)  # holds the event loop: the call in flight cannot end

asyncio.run(call_env(run, (None, None), "run(item, client)", "episode g0-s2", 0.3, clock))
"""


def test_an_agent_that_blocks_the_event_loop_with_a_model_call_in_flight_ends_the_process():
    # the blocked time is its own, not the model's: the call in flight cannot progress
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", BLOCKS_WITH_A_CALL_IN_FLIGHT], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=30)
    assert proc.returncode == 1, proc.stderr
    found = re.fullmatch(r"\[env-watchdog\] run\(item, client\) has run ([\d.]+) s in episode g0-s2 "
                         r"\(rollout\.env_timeout_s=0\.3\); [\d.]+ s of it with a model call in flight.*"
                         r"it blocks this process's event loop, so the process is ended", proc.stderr.strip())
    assert found, proc.stderr
    assert float(found.group(1)) < 5, proc.stderr
