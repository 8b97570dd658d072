"""The default workflow's tool loop and the example workflows, against a scripted client
(``tests/support/scripted.py``): calls parsed at the end tag, results as observations the model
did not sample, failing tools as error observations, the turn limit, and the examples' shapes."""

from __future__ import annotations

import asyncio

import pytest

from areal_async.config import RewardConfig
from areal_async.reward.pool import RewardPool
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EnvWorkflow, EpisodeItem, OpenAIWorkflow, ToolLoop, load_workflow
from areal_async.tools import ToolSet
from tests.support.scripted import ScriptedClient

QUESTION = [{"role": "user", "content": "What is 12 times 7?"}]


def run(tok, workflow, replies, max_turns=4, answer="84", question=QUESTION):
    client = ScriptedClient(tok, replies)
    prompt = tok(tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    ep = Episode(client, tok, lambda ids: tok.decode(ids, skip_special_tokens=True), 0, 0, 9, prompt, question,
                 {"temperature": 1.0, "stop_token_ids": [tok.eos_token_id]}, server=0, max_new_tokens=64,
                 max_turns=max_turns)
    sample = asyncio.run(workflow(ep, EpisodeItem(question, answer)))
    sample.check()
    return ep, sample, client.calls


def spans_of(ep):
    return ep.conversations[0].turn_spans.tolist()


def test_a_tool_call_stops_the_turn_its_result_is_an_observation_and_the_answer_is_scored(tok):
    tools = ToolSet(["calculator"])
    with RewardPool(RewardConfig(num_procs=1)) as rewards:
        ep, sample, calls = run(tok, ToolLoop(rewards, "math", tools),
                                ["Let me compute. <calculator>12*7</calculator>", "So \\boxed{84}."])
    assert [c[0] for c in calls] == ["g0-s0", "g0-s0-t1"]
    assert all(c[2]["stop"] == ["</calculator>"] for c in calls)
    assert sample.correct and sample.stats.turns == 2 and sample.stats.tool_calls == 1
    assert sample.stats.tool_errors == 0 and not sample.stats.truncated
    (_, end), (start, _) = spans_of(ep)
    mask = sample.loss_mask.tolist()
    assert set(mask[end:start]) == {0}, "the tool's result and the template tokens are not sampled"
    observation = tok.decode(sample.output_ids.tolist()[end:start])
    assert observation == "<|im_end|>\n<|im_start|>tool\n<result>\n84\n</result><|im_end|>\n<|im_start|>assistant\n"
    assert calls[1][1] == ep.prompt_ids + sample.output_ids.tolist()[:start], "turn 2 saw other ids"


@pytest.mark.parametrize("code, kind, shown", [
    ("raise ValueError('no')", "raised", "ValueError: no"),
    ("while True: pass", "timeout", "timed out after 1.0 s"),
    ("print('x' * 10**6)", "output_limit", "output over"),
])
def test_a_tool_that_raises_hangs_or_floods_is_an_error_observation_and_the_episode_goes_on(tok, code, kind, shown):
    tools = ToolSet(["python"], timeout_s=1.0, max_output_bytes=256)
    with RewardPool(RewardConfig(num_procs=1)) as rewards:
        ep, sample, _ = run(tok, ToolLoop(rewards, "math", tools), [f"<python>{code}</python>", "\\boxed{84}"])
    assert sample.stats.tool_calls == 1 and sample.stats.tool_errors == 1 and sample.correct
    (_, end), (start, _) = spans_of(ep)
    observation = tok.decode(sample.output_ids.tolist()[end:start])
    assert "<result>\nerror: " in observation and shown in observation, observation
    assert len(observation) < 1000


def test_a_call_on_the_last_allowed_turn_truncates_the_episode(tok):
    with RewardPool(RewardConfig(num_procs=1)) as rewards:
        ep, sample, calls = run(tok, ToolLoop(rewards, "math", ToolSet(["calculator"])),
                                ["<calculator>1+1</calculator>"] * 3, max_turns=2)
    assert len(calls) == 2 and sample.stats.truncated and sample.stats.tool_calls == 1 and not sample.correct


def test_without_tools_the_loop_is_one_answer_with_no_stop_strings(tok):
    with RewardPool(RewardConfig(num_procs=1)) as rewards:
        ep, sample, calls = run(tok, ToolLoop(rewards, "math"), ["<calculator>1+1</calculator> \\boxed{84}"])
    assert len(calls) == 1 and "stop" not in calls[0][2]
    assert sample.correct and sample.loss_mask is None and sample.stats is None


def test_the_calculator_env_example_calls_the_tool_and_ends_on_an_answer(tok):
    workflow = load_workflow("examples.workflows.calculator_env:CalculatorEnv", 1.0, 1.0)
    assert isinstance(workflow, EnvWorkflow)
    ep, sample, calls = run(tok, workflow, ["<calculator>12*7</calculator>", "It is \\boxed{84}."])
    assert sample.turn_rewards.tolist() == [0.0, 1.0] and sample.correct and sample.stats.tool_calls == 1
    [segment] = sample.segments  # its system prompt makes its own prompt: the episode lives in a segment
    assert sample.output_ids.tolist() == [] and "You can call a tool" in tok.decode(segment.prompt_ids.tolist())
    assert "<result>\n84\n</result>" in tok.decode(segment.output_ids.tolist())


def test_the_calculator_env_example_keeps_a_prompt_that_states_the_tools_rules(tok):
    question = [{"role": "system", "content": ToolSet(["calculator"]).system_prompt() + "\nBox the answer."},
                *QUESTION]  # as data.task=calc writes it
    ep, sample, calls = run(tok, load_workflow("examples.workflows.calculator_env:CalculatorEnv", 1.0, 1.0),
                            ["<calculator>12*7</calculator>", "It is \\boxed{84}."], question=question)
    assert sample.segments == [] and sample.correct, "the group's prompt, shared by the group, once"
    assert calls[0][1] == ep.prompt_ids and tok.decode(ep.prompt_ids).count("You can call a tool") == 1


def test_the_retry_agent_example_gets_feedback_and_a_reward_on_the_right_turn(tok):
    workflow = load_workflow("examples.workflows.retry_agent:run", 1.0, 1.0)
    assert isinstance(workflow, OpenAIWorkflow)
    ep, sample, calls = run(tok, workflow, ["\\boxed{80}", "\\boxed{84}"])
    assert len(calls) == 2 and sample.turn_rewards.tolist() == [0.0, 1.0] and sample.correct
    assert sample.segments == [], "the agent only extends its conversation"
    (_, end), (start, _) = spans_of(ep)
    assert "That is not right" in tok.decode(sample.output_ids.tolist()[end:start])


async def one_call_too_many(item, client):
    for _ in range(3):
        await client.chat.completions.create(model="p", messages=item.messages)
    return 1.0


def test_an_agent_that_calls_past_max_turns_ends_truncated_with_reward_0(tok):
    ep, sample, calls = run(tok, OpenAIWorkflow(one_call_too_many, 1.0, 1.0), ["a", "b", "c"], max_turns=2)
    assert len(calls) == 2 and sample.stats.truncated and sample.reward == 0.0 and not sample.correct
    assert len(sample.segments) == 1, "the second call repeated the first prompt: its own sequence"
