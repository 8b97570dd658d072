"""What an ``Env`` or an agent's ``run`` may give the workflow, and what ends its episode: stop
strings, observations, return values, a failing constructor, an agent's exception after a limit,
a call that ignores its cancellation, and episodes cut by a limit. Against a scripted client
(``tests/support/scripted.py``)."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from areal_async.rollout import env_limit
from areal_async.rollout.env_limit import EnvTimeout
from areal_async.rollout.workflows import EnvWorkflow, OpenAIWorkflow, ToolLoop, load_workflow
from areal_async.trainer.report import batch_metrics, episode_metrics
from areal_async.types import Array, Trajectory
from tests.support.scripted import run_in_loop, run_workflow, scripted_episode


def env(first=None, later=None, stop=None, turns: int = 1):
    """An Env class whose ``reset`` gives ``first``, each ``step`` ``later``, done after ``turns``."""

    class ObsEnv:
        def reset(self, item, seed):
            return first

        def step(self, action):
            return later, 1.0, action.turn + 1 >= turns

    if stop is not None:
        ObsEnv.stop = stop
    return ObsEnv


def test_a_stop_string_is_one_stop_and_another_stop_is_refused_naming_the_class(tok):
    # "</x>" was split into "<", "/", "x", ">": every turn ended at its first "<"
    ep = scripted_episode(tok, replies=["x</x>"])
    run_workflow(EnvWorkflow(env(stop="</x>")), ep)
    assert ep.client.calls[0][2]["stop"] == ["</x>"]
    for bad in (5, {"</x>"}, ["</x>", 3]):
        with pytest.raises(TypeError, match=r"ObsEnv\.stop is .*; give a stop string or a list of them"):
            run_workflow(EnvWorkflow(env(stop=bad), on_env_error="zero"), scripted_episode(tok))


@pytest.mark.parametrize("method, first, later, kind, words", [
    ("reset", [], None, ValueError, r"an empty observation \[\] in episode g0-s2; return None"),
    ("reset", "You are in a maze.", None, TypeError, r"the observation str 'You are in a maze\.' in episode g0-s2;"),
    ("step", None, np.zeros((2, 2), dtype=np.int64), TypeError, r"the observation ndarray .* in episode g0-s2, turn 0;"),
    ("step", None, [{"content": "no role"}], TypeError, r"the observation list .* in episode g0-s2, turn 0;"),
    ("step", None, [{"role": "user"}], TypeError, r"the message 0 \{'role': 'user'\} in episode g0-s2, turn 0; a chat"),
    ("step", None, [{"role": "user", "content": "ok"}, {"role": "user", "content": None}], TypeError,
     r"the message 1 \{'role': 'user', 'content': None\} in episode g0-s2, turn 0; a chat message has"),
    ("reset", [{"role": "user", "content": 42}], None, TypeError,
     r"the message 0 \{'role': 'user', 'content': 42\} in episode g0-s2; a chat message has"),
    ("step", None, [{"role": "user", "content": ["a"]}], TypeError, r"the message 0 .*'content': \['a'\]\} in "),
    ("step", None, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], TypeError,
     r"the message 0 .*'image_url'.* in episode g0-s2, turn 0; a chat message has a string 'role' and a 'content'"),
    ("step", None, [{"role": 1, "content": "x"}], TypeError, r"the message 0 \{'role': 1, 'content': 'x'\} in "),
])
def test_a_malformed_observation_names_the_method_episode_and_value_even_under_zero(tok, method, first, later,
                                                                                   kind, words):
    # they failed inside the chat template or the conversation, naming neither the env nor the episode
    with pytest.raises(kind, match=rf"(?s)ObsEnv\.{method} (returned|gave) {words}"):
        run_workflow(EnvWorkflow(env(first, later, turns=2), on_env_error="zero"), scripted_episode(tok))


def test_numpy_token_ids_are_ids_and_an_empty_step_observation_is_none(tok):
    # a numpy array or numpy ints were taken for chat messages (a TypeError in the template)
    for later in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7]):
        sample = run_workflow(EnvWorkflow(env(None, later, turns=2)), scripted_episode(tok))
        assert sample.stats.turns == 2
        out = sample.output_ids.tolist()
        assert any(out[i:i + 2] == [5, 6] for i in range(len(out))), out
    empty = run_workflow(EnvWorkflow(env(None, [], turns=2)), scripted_episode(tok))
    none = run_workflow(EnvWorkflow(env(None, None, turns=2)), scripted_episode(tok))
    assert empty.output_ids == none.output_ids


def test_an_observations_text_parts_are_its_content_joined(tok):
    # the template rendered the list as its Python repr, "[{'type': 'text', ...}]", into the episode
    parts = [{"role": "user", "content": [{"type": "text", "text": "try "}, {"type": "text", "text": "again"}]}]
    joined = run_workflow(EnvWorkflow(env(None, parts, turns=2)), scripted_episode(tok))
    text = run_workflow(EnvWorkflow(env(None, [{"role": "user", "content": "try again"}], turns=2)),
                        scripted_episode(tok))
    assert joined.output_ids == text.output_ids and "try again" in tok.decode(joined.output_ids.tolist())


class InitFails:
    def __init__(self):
        raise ConnectionError("sandbox pool exhausted")

    def reset(self, item, seed):
        return None

    def step(self, action):
        return None, 1.0, True


def test_a_failing_constructor_is_the_envs_failure(tok):
    # it escaped on_env_error: the job failed with a bare traceback, whatever the setting
    sample = run_workflow(EnvWorkflow(InitFails, on_env_error="zero"), scripted_episode(tok))
    assert sample.stats.env_error and sample.stats.turns == 0 and sample.reward == 0.0
    with pytest.raises(RuntimeError, match=r"InitFails\.__init__ raised in episode g0-s2: "
                                           r"ConnectionError\('sandbox pool exhausted'\)"):
        run_workflow(EnvWorkflow(InitFails), scripted_episode(tok))


class SwallowsCancel:
    """A retry loop whose bare except swallows cancellation, for 3 s."""

    def reset(self, item, seed):
        return None

    async def step(self, action):
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            try:
                await asyncio.sleep(end - time.monotonic())
            except asyncio.CancelledError:  # the bug under test (closing it still ends it)
                pass
        return None, 1.0, True


def test_a_call_that_ignores_its_cancellation_is_abandoned_after_a_grace(tok, monkeypatch):
    # the episode waited for it past its limit (forever, when it retries forever)
    monkeypatch.setattr(env_limit, "GRACE_S", 0.2)
    t0 = time.monotonic()
    error, left = run_in_loop(EnvWorkflow(SwallowsCancel, 0.2), scripted_episode(tok))
    assert isinstance(error, EnvTimeout) and time.monotonic() - t0 < 2.0
    assert re.search(r"SwallowsCancel\.step has run [\d.]+ s in episode g0-s2, turn 0 .*ignored its "
                     r"cancellation for 0\.2 s .*let CancelledError propagate", str(error)), error
    assert not left, "nothing of it is left on the loop"
    sample = run_workflow(EnvWorkflow(SwallowsCancel, 0.2, on_env_error="zero"), scripted_episode(tok))
    assert sample.stats.env_error and sample.turn_rewards.tolist() == [0.0]


async def bug_after_cut(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    raise KeyError("agent bug")


async def gives_up_when_refused(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    await client.chat.completions.create(model="p", messages=[*item.messages, {"role": "user", "content": "x"}])
    return 1.0


def test_an_agents_exception_after_a_cut_turn_is_its_failure_after_a_refusal_reward_0(tok):
    # the cut turn (answered 200) set truncated, and the bug was dropped: reward 0, no word
    ep = scripted_episode(tok, replies=["a b c d e f"], max_episode_tokens=2)
    with pytest.raises(RuntimeError, match=r"bug_after_cut raised in episode g0-s2: KeyError"):
        run_workflow(OpenAIWorkflow(bug_after_cut, 1.0, 1.0), ep)
    assert ep.stats["truncated"] and ep.turns[0].finish_reason == "length"
    sample = run_workflow(OpenAIWorkflow(bug_after_cut, 1.0, 1.0, on_env_error="zero"),
                          scripted_episode(tok, replies=["a b c d e f"], max_episode_tokens=2))
    assert sample.stats.env_error and sample.stats.truncated
    sample = run_workflow(OpenAIWorkflow(gives_up_when_refused, 1.0, 1.0), scripted_episode(tok, max_turns=1))
    assert sample.reward == 0.0 and sample.stats.truncated and not sample.stats.env_error


def agent_returning(value):
    async def returns(item, client):
        await client.chat.completions.create(model="p", messages=item.messages)
        await client.chat.completions.create(model="p", messages=[*item.messages, {"role": "user", "content": "x"}])
        return value

    return returns


def test_an_agents_reward_is_any_real_number_and_a_bool_is_refused(tok):
    # np.float32(1.0) was refused though an Env's step may return it; {True: 1.0} passed as turn 1
    assert run_workflow(OpenAIWorkflow(agent_returning(np.float32(1.0)), 1.0, 1.0), scripted_episode(tok)).reward == 1.0
    per_turn = run_workflow(OpenAIWorkflow(agent_returning({np.int64(1): 2.0}), 1.0, 1.0), scripted_episode(tok))
    assert per_turn.turn_rewards.tolist() == [0.0, 2.0]
    with pytest.raises(TypeError, match=r"returns returned rewards for turns \[True\] .*key each reward by its turn"):
        run_workflow(OpenAIWorkflow(agent_returning({True: 1.0}), 1.0, 1.0), scripted_episode(tok))
    with pytest.raises(TypeError, match=r"returns returned True \(bool\) in episode g0-s2; return the episode's"):
        run_workflow(OpenAIWorkflow(agent_returning(True), 1.0, 1.0), scripted_episode(tok))


class Rewards:
    async def score(self, fn, text, answer, prompt=None, item=None):
        class Score:
            reward, correct, error = 1.0, True, False

        return Score()


def test_a_single_turn_cut_by_max_episode_tokens_is_counted_truncated(tok):
    # the plain sample carried no stats, so rollout/truncated read 0 for it
    cut = run_workflow(ToolLoop(Rewards(), "r"), scripted_episode(tok, replies=["a b c d e f"], max_episode_tokens=2))
    whole = run_workflow(ToolLoop(Rewards(), "r"), scripted_episode(tok, max_episode_tokens=8))
    assert cut.loss_mask is None and cut.stats.truncated and cut.finish_reason == "length"
    assert whole.stats is None and whole.loss_mask is None, "an untruncated answer keeps its plain wire form"
    prompt = Array.of([1, 2], "int32")
    trajs = [Trajectory(group_id=0, prompt_ids=prompt, samples=[cut, whole], data_index=0)]
    assert episode_metrics(trajs)["rollout/truncated"] == 0.5


def test_a_first_observation_that_fills_the_context_is_printed_once_a_minute(tok, capsys):
    # 0-turn episodes, trained on nothing, and nothing said why
    # and its return 0 entered its group's mean and std: an empty episode, like an agent's with no call
    workflow = EnvWorkflow(env(first=[5] * 40))
    for _ in range(2):
        sample = run_workflow(workflow, scripted_episode(tok, max_seq_len=32))
        assert sample.stats.turns == 0 and sample.stats.truncated
        assert sample.empty() and not sample.scored() and not sample.correct
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and re.fullmatch(
        r"\[env\] .*ObsEnv\.reset's first observation fills the context in episode g0-s2: 40 tokens of "
        r"inference\.max_seq_len=32, .*rollout/truncated and rollout/empty_episodes.*raise inference\.max_seq_len; "
        r"1 so far in this worker.*", printed[0]), printed
    trajs = [Trajectory(group_id=0, prompt_ids=Array.of([1, 2], "int32"), samples=[sample], data_index=0)]
    assert batch_metrics(trajs, 0, 1.0)["rollout/empty_episodes"] == 1.0


def step_env(result):
    """An Env class whose every ``step`` returns ``result``."""

    class StepEnv:
        def reset(self, item, seed):
            return None

        def step(self, action):
            return result

    return StepEnv


@pytest.mark.parametrize("result, words", [
    ((None, 1.0, "False"), r"done 'False' \(str\)"),
    ((None, 1.0, None), r"done None \(NoneType\)"),
    ((None, 1.0, True, {"tool_calls": "two"}), r"info\['tool_calls'\] 'two' \(str\)"),
    ((None, 1.0, True, {"tool_errors": 1.5}), r"info\['tool_errors'\] 1\.5 \(float\)"),
])
def test_a_mistyped_done_or_info_count_is_named_even_under_zero(tok, result, words):
    # done="False" ended the episode (a non-empty string is true); a count that is no int failed with
    # int()'s bare "invalid literal", naming neither the env nor the episode
    with pytest.raises(TypeError, match=rf"StepEnv\.step returned {words} in episode g0-s2, turn 0;"):
        run_workflow(EnvWorkflow(step_env(result), on_env_error="zero"), scripted_episode(tok))


def test_done_may_be_a_numpy_bool_and_counts_numpy_ints(tok):
    sample = run_workflow(EnvWorkflow(step_env((None, 1.0, np.bool_(True), {"tool_calls": np.int64(2)}))),
                          scripted_episode(tok))
    assert sample.stats.turns == 1 and sample.stats.tool_calls == 2


ENVS = """
class NeedsArg:
    def __init__(self, url): pass
    def reset(self, item, seed): return None
    def step(self, action): return None, 0.0, True
class ResetNoSeed:
    def reset(self, item): return None
    def step(self, action): return None, 0.0, True
class StepTwo:
    def reset(self, item, seed): return None
    def step(self, action, extra): return None, 0.0, True
class Fine:
    def __init__(self, url="http://sandbox"): pass
    def reset(self, item, seed=0): return None
    @staticmethod
    def step(action): return None, 0.0, True
"""


@pytest.mark.parametrize("name, words", [
    ("NeedsArg", r"NeedsArg\(\) fails: missing a required argument: 'url'; an Env class is called with no arguments"),
    ("ResetNoSeed", r"ResetNoSeed\.reset\(item, seed\) fails: too many positional arguments"),
    ("StepTwo", r"StepTwo\.step\(action\) fails: missing a required argument: 'extra'"),
])
def test_an_env_whose_methods_cannot_take_the_workflows_arguments_is_refused_at_load(tmp_path, monkeypatch, name,
                                                                                    words):
    # it failed in every episode: under on_env_error=zero each was zeroed as an env failure, without end
    (tmp_path / "sig_envs.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=rf"rollout\.workflow 'sig_envs:{name}': {words}"):
        load_workflow(f"sig_envs:{name}", 1.0, 1.0, on_env_error="zero")
    assert isinstance(load_workflow("sig_envs:Fine", 1.0, 1.0), EnvWorkflow)
