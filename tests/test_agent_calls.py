"""An agent's model calls (``OpenAIWorkflow`` and its recording endpoint) against a scripted client
(``tests/support/scripted.py``): what fails in the engine is the engine's failure, not the agent's,
and a call the endpoint cannot answer is refused naming the field."""

from __future__ import annotations

import json
import re

import msgspec
import openai
import pytest

from areal_async.config import AlgoConfig
from areal_async.inference.client import ServerError
from areal_async.rollout.workflows import OpenAIWorkflow
from areal_async.trainer.plan import build_sequences
from areal_async.trainer.report import batch_metrics
from areal_async.types import Array, Trajectory
from tests.support.scripted import ScriptedClient, run_workflow, scripted_episode


class DeadServer(ScriptedClient):
    async def generate(self, input_ids, sampling, rid, server=None, session=None):
        raise ServerError("scripted://0", 502, "server gone")


def dead_server_episode(tok):
    ep = scripted_episode(tok)
    ep.client = DeadServer(tok, [])
    return ep


async def one_call(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    return 1.0


async def catches_everything(item, client):
    try:
        await client.chat.completions.create(model="p", messages=item.messages)
    except Exception:
        return 0.5
    return 1.0


@pytest.mark.parametrize("on_env_error", ["raise", "zero"])
@pytest.mark.parametrize("run", [one_call, catches_everything])
def test_an_engine_failure_in_an_agents_call_fails_the_worker_as_it_does_in_any_workflow(tok, on_env_error, run):
    # it was run's failure: zeroed under on_env_error=zero (the group trained on nothing, never replayed),
    # or a sample with the agent's reward for a turn that never came
    with pytest.raises(ServerError, match="server gone"):
        run_workflow(OpenAIWorkflow(run, 1.0, 1.0, on_env_error=on_env_error), dead_server_episode(tok))


@pytest.mark.parametrize("kwargs, words", [
    ({"messages": ["What is 12 times 7?"]}, r"messages\[0\] is str 'What is 12 times 7\?', not a chat message"),
    ({"messages": [{"content": "hi"}]}, r"messages\[0\] has no 'role'"),
    ({"max_tokens": -3}, r"max_tokens=-3: give a whole number >= 1"),
    ({"max_tokens": 0}, r"max_tokens=0: give a whole number >= 1"),
    ({"max_completion_tokens": 2.5}, r"max_completion_tokens=2.5: give a whole number >= 1"),
    ({"stop": 5}, r"stop=5: give a stop string or a list of them"),
    ({"stop": ["</x>", ""]}, r"stop=\['</x>', ''\]: give a stop string or a list of them \(none empty\)"),
])
def test_a_call_the_endpoint_cannot_answer_is_refused_naming_the_field(tok, kwargs, words):
    # messages=["..."] failed inside the endpoint with "dictionary update sequence element #0 ...", stop=5
    # with "'int' object is not iterable";
    # max_tokens=-3 was counted as a limit the episode reached (truncated, reward 0, no error),
    # and max_tokens=0 as no limit
    seen = {}

    async def run(item, client):
        with pytest.raises(openai.BadRequestError, match=words):
            await client.chat.completions.create(model="p", **{"messages": item.messages, **kwargs})
        seen["refused"] = True
        await client.chat.completions.create(model="p", messages=item.messages)
        return 1.0

    sample = run_workflow(OpenAIWorkflow(run, 1.0, 1.0), scripted_episode(tok))
    assert seen["refused"] and sample.reward == 1.0 and sample.correct
    assert not (sample.stats and sample.stats.truncated), "a refused call is no limit the episode reached"


@pytest.mark.parametrize("kwargs, words", [
    ({"presence_penalty": 0.5}, r"presence_penalty=0\.5: an episode samples as the run does"),
    ({"frequency_penalty": -1.0}, r"frequency_penalty=-1\.0: an episode samples as the run does"),
    ({"logit_bias": {"42": 5}}, r"logit_bias=\{'42': 5\}: an episode samples as the run does"),
    ({"response_format": {"type": "json_object"}}, r"response_format=\{'type': 'json_object'\}: an episode"),
])
def test_a_call_that_would_sample_otherwise_is_refused_and_the_defaults_pass(tok, kwargs, words):
    # they were ignored: the agent believed its tokens penalised, biased or constrained, and they were not
    async def run(item, client):
        with pytest.raises(openai.BadRequestError, match=words):
            await client.chat.completions.create(model="p", messages=item.messages, **kwargs)
        await client.chat.completions.create(model="p", messages=item.messages, presence_penalty=0,
                                             frequency_penalty=0.0, logit_bias={},
                                             response_format={"type": "text"})
        return 1.0

    assert run_workflow(OpenAIWorkflow(run, 1.0, 1.0), scripted_episode(tok)).stats is None


STATING_AGENT = """
import openai


async def run(item, client):
    await client.chat.completions.create(model="p", messages=item.messages, temperature=0.7, top_p=0.9)
    try:
        await client.chat.completions.create(model="p", messages=item.messages, temperature=0.5)
    except openai.BadRequestError:
        return 1.0  # another temperature stays refused
    return 0.0
"""


def test_an_agent_that_states_the_runs_sampling_runs_in_the_greedy_evaluation_too(tok, tmp_path, monkeypatch):
    # the evaluation's workflow samples at temperature 0 and refused the run's temperature=0.7 with a 400:
    # an agent written as docs/workflows.md says trained, and each of its evaluation episodes raised
    from areal_async.config import RolloutConfig
    from areal_async.rollout.workflows import build_workflow

    (tmp_path / "stating_agent.py").write_text(STATING_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    rollout = RolloutConfig(temperature=0.7, top_p=0.9, workflow="stating_agent:run")
    for greedy in (True, False):
        assert run_workflow(build_workflow(rollout, None, None, greedy=greedy), scripted_episode(tok)).reward == 1.0


async def no_call(item, client):
    return 0.5


async def no_call_per_turn(item, client):
    return {}


def test_an_agent_that_makes_no_model_call_is_an_empty_episode_that_enters_no_statistics(tok, capsys):
    # it was correct, with reward 0.5 in rollout/reward and in its group's mean and std, though
    # nothing of it can be trained and its reward says nothing about the policy
    workflow = OpenAIWorkflow(no_call, 1.0, 1.0)
    for _ in range(2):
        empty = run_workflow(workflow, scripted_episode(tok))
        assert empty.output_ids.tolist() == [] and empty.stats.turns == 0 and empty.reward == 0.5
        assert empty.empty() and not empty.scored() and not empty.correct and not empty.stats.env_error
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and re.fullmatch(
        r"\[agent\] no_call ended episode g0-s2 with no model turn \(it made no call\) and the reward 0\.5: an "
        r"empty episode, not trained, its return in no statistics \(counted in rollout/empty_episodes\); "
        r"1 so far in this worker, at most one printed a minute", printed[0]), printed
    assert run_workflow(OpenAIWorkflow(no_call_per_turn, 1.0, 1.0), scripted_episode(tok)).empty()
    assert "no_call_per_turn ended episode g0-s2 with no model turn (it made no call) and the reward 0:" in \
        capsys.readouterr().out
    good = run_workflow(OpenAIWorkflow(one_call, 1.0, 1.0), scripted_episode(tok))
    bad = msgspec.structs.replace(good, index=1, reward=-1.0, correct=False)
    group = Trajectory(group_id=0, prompt_ids=Array.of([1, 2], "int32"), data_index=0,
                       samples=[msgspec.structs.replace(good, index=0), bad, msgspec.structs.replace(empty, index=2)])
    alone = msgspec.structs.replace(group, samples=group.samples[:2])
    for batch_norm in (False, True):
        got, want = build_sequences([group], AlgoConfig(batch_norm=batch_norm)), \
            build_sequences([alone], AlgoConfig(batch_norm=batch_norm))
        assert all(g.advantages.equal(w.advantages) for g, w in zip(got, want)), "a group of its two others"
        assert not got[2].advantages.any() and not got[2].loss_mask.any()
    m = batch_metrics([group], step=0, step_s=1.0)
    assert m["rollout/reward"] == 0.0 and m["rollout/correct"] == 0.5 and m["rollout/empty_episodes"] == 1.0
    assert batch_metrics([alone], step=0, step_s=1.0)["rollout/empty_episodes"] == 0.0


def test_logprobs_are_the_turns_sampled_tokens_in_openais_shape_and_top_logprobs_is_refused(tok):
    # logprobs=True was answered with logprobs null, and top_logprobs=2 with nothing, without a word
    from openai.types.chat import ChatCompletion

    seen = {}

    async def run(item, client):
        raw = await client.chat.completions.with_raw_response.create(model="p", messages=item.messages,
                                                                     logprobs=True)
        seen["body"] = json.loads(raw.text)
        for kwargs, words in [({"top_logprobs": 2}, r"top_logprobs=2: .*the sampled token's log-prob only"),
                              ({"top_logprobs": -1}, r"top_logprobs=-1: give a whole number >= 0"),
                              ({"logprobs": "yes"}, r"logprobs='yes': give true or false")]:
            with pytest.raises(openai.BadRequestError, match=words):
                await client.chat.completions.create(model="p", messages=item.messages, **{"logprobs": True, **kwargs})
        seen["zero"] = await client.chat.completions.create(model="p", messages=item.messages, logprobs=True,
                                                            top_logprobs=0)
        seen["plain"] = await client.chat.completions.create(model="p", messages=item.messages)
        return 1.0

    ep = scripted_episode(tok, replies=["12 times 7 is 84.", "84", "84"])
    run_workflow(OpenAIWorkflow(run, 1.0, 1.0), ep)
    reply = ChatCompletion.model_validate(seen["body"])  # the openai package's types, checked
    content, turn = reply.choices[0].logprobs.content, ep.turns[0]
    assert [c.logprob for c in content] == turn.logprobs == [-0.5] * len(turn.ids), "one per sampled token"
    assert [c.token for c in content] == [tok.decode([t]) for t in turn.ids] and turn.ids[-1] == tok.eos_token_id
    assert b"".join(bytes(c.bytes) for c in content) == tok.decode(turn.ids).encode()
    assert all(c.top_logprobs == [] for c in content) and reply.choices[0].message.content == turn.text
    assert [c.logprob for c in seen["zero"].choices[0].logprobs.content] == [-0.5] * len(ep.turns[1].ids)
    assert seen["plain"].choices[0].logprobs is None and len(ep.turns) == 3
