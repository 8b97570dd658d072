"""An environment that fails (``rollout.on_env_error``), an agent's ``run`` past
``rollout.env_timeout_s``, and observation ids outside the vocabulary; against a scripted client
(``tests/support/scripted.py``)."""

from __future__ import annotations

import asyncio
import json
import re

import msgspec
import pytest
import torch

from areal_async.algo.advantages import group_advantages
from areal_async.config import AlgoConfig, load_config
from areal_async.model.source import model_vocab_size
from areal_async.rollout.env_errors import EnvErrors, EnvFailed
from areal_async.rollout.env_limit import EnvTimeout
from areal_async.rollout.workflows import EnvWorkflow, OpenAIWorkflow
from areal_async.trainer.plan import build_sequences
from areal_async.trainer.report import batch_metrics
from areal_async.types import Array, EpisodeStats, Sample, Trajectory
from tests.support.episodes import group0
from tests.support.scripted import run_workflow, scripted_episode


class StepFails:
    """Turn 0: reward 1, go on; turn 1: ``step`` raises."""

    def reset(self, item, seed):
        return None

    def step(self, action):
        if action.turn == 1:
            raise ConnectionError("sandbox gone")
        return [{"role": "user", "content": "again"}], 1.0, False


class ResetFails:
    def reset(self, item, seed):
        raise ConnectionError("no sandbox")

    def step(self, action):
        return None, 1.0, True


class StepHangs:
    def reset(self, item, seed):
        return None

    async def step(self, action):
        await asyncio.Event().wait()


def test_under_zero_a_failing_step_ends_the_episode_that_turn_rewarded_0_and_counted(tok, capsys):
    ep = scripted_episode(tok)
    sample = run_workflow(EnvWorkflow(StepFails, on_env_error="zero"), ep)
    assert sample.turn_rewards.tolist() == [1.0, 0.0], "turn 0 keeps its reward, the failed turn gets 0"
    assert sample.stats.env_error and sample.stats.turns == 2 and not sample.correct
    assert sample.sampled()[-1], "the episode ends on its last turn: no observation after it"
    printed = capsys.readouterr().out
    assert re.search(r"\[env\] StepFails\.step failed in episode g0-s2, turn 1: ConnectionError\('sandbox gone'\); "
                     r"the episode ends there with reward 0", printed), printed
    with pytest.raises(RuntimeError, match=r"StepFails\.step raised in episode g0-s2, turn 1: "
                                           r"ConnectionError\('sandbox gone'\); .*rollout\.on_env_error=zero"):
        run_workflow(EnvWorkflow(StepFails), scripted_episode(tok))  # raise: the default


def test_under_zero_a_failing_reset_or_a_step_past_the_limit_ends_the_episode(tok):
    sample = run_workflow(EnvWorkflow(ResetFails, on_env_error="zero"), scripted_episode(tok))
    assert sample.output_ids.tolist() == [] and sample.turn_rewards.tolist() == [] and sample.reward == 0.0
    assert sample.stats.env_error and sample.stats.turns == 0 and not sample.correct
    sample = run_workflow(EnvWorkflow(StepHangs, 0.2, on_env_error="zero"), scripted_episode(tok))
    assert sample.turn_rewards.tolist() == [0.0] and sample.stats.env_error
    with pytest.raises(EnvTimeout, match=r"StepHangs\.step has run"):
        run_workflow(EnvWorkflow(StepHangs, 0.2), scripted_episode(tok))


def test_failures_are_printed_first_then_at_most_one_a_minute(capsys):
    now = [0.0]
    errors = EnvErrors("zero", clock=lambda: now[0])
    for t in (0.0, 30.0, 59.9, 60.0, 61.0):
        now[0] = t
        stats = {"env_error": False}
        with pytest.raises(EnvFailed):
            errors.fail(ValueError(str(t)), "E.step", "episode g0-s0, turn 0", stats)
        assert stats["env_error"]
    printed = capsys.readouterr().out.splitlines()
    assert [re.search(r"ValueError\('([\d.]+)'\)", line).group(1) for line in printed] == ["0.0", "60.0"]
    assert "2 so far" not in printed[1] and "4 so far" in printed[1]


async def gives_up(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    raise ConnectionError("tool server down")


async def stalls(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    await asyncio.Event().wait()


def test_under_zero_an_agents_failing_run_ends_the_episode_with_reward_0(tok):
    sample = run_workflow(OpenAIWorkflow(gives_up, 1.0, 1.0, on_env_error="zero"), scripted_episode(tok))
    assert sample.reward == 0.0 and not sample.correct and sample.stats.env_error and sample.stats.turns == 1
    with pytest.raises(RuntimeError, match=r"gives_up raised in episode g0-s2: ConnectionError"):
        run_workflow(OpenAIWorkflow(gives_up, 1.0, 1.0), scripted_episode(tok))


def test_an_agents_run_has_the_time_limit_subject_to_on_env_error(tok):
    # a run that never returned held its group, and the trainer waited for it, forever
    with pytest.raises(EnvTimeout, match=r"stalls\(item, client\) has run [\d.]+ s in episode g0-s2 "
                                         r"\(rollout\.env_timeout_s=0\.2\); .*raise rollout\.env_timeout_s"):
        run_workflow(OpenAIWorkflow(stalls, 1.0, 1.0, env_timeout_s=0.2), scripted_episode(tok))
    workflow = OpenAIWorkflow(stalls, 1.0, 1.0, env_timeout_s=0.2, on_env_error="zero")
    sample = run_workflow(workflow, scripted_episode(tok))
    assert sample.reward == 0.0 and sample.stats.env_error and sample.stats.turns == 1


def ids_env(first, later):
    class IdsEnv:
        def reset(self, item, seed):
            return first

        def step(self, action):
            return later, 0.0, action.turn == 1

    return IdsEnv


def test_an_observation_id_outside_the_vocabulary_is_named_even_under_zero(tok):
    # it reached the engine: on a GPU a device-side assert that named neither the env nor the id
    n = len(tok)
    prompt = tok.encode("Hi", add_special_tokens=False)
    with pytest.raises(ValueError, match=rf"IdsEnv\.reset gave the observation token id {n} in episode g0-s2, "
                                         rf"outside the vocabulary \[0, {n}\)"):
        run_workflow(EnvWorkflow(ids_env(prompt + [n], None), on_env_error="zero"), scripted_episode(tok))
    with pytest.raises(ValueError, match=rf"IdsEnv\.step gave the observation token id -1 in episode g0-s2, "
                                         rf"turn 0, outside the vocabulary \[0, {n}\)"):
        run_workflow(EnvWorkflow(ids_env(None, [5, -1]), on_env_error="zero"), scripted_episode(tok))
    # the model's embedding may have more rows than the tokenizer has tokens: those ids are the engine's
    sample = run_workflow(EnvWorkflow(ids_env(None, [n + 3]), vocab_size=n + 4), scripted_episode(tok))
    assert n + 3 in sample.output_ids.tolist()


def test_the_vocabulary_bound_is_the_models_embedding_rows(tiny_model_dir, tok, tmp_path):
    assert model_vocab_size(tiny_model_dir) == len(tok)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert model_vocab_size(tmp_path) == 151936 and model_vocab_size(tmp_path / "none") == 0


def test_an_episode_the_env_ended_stays_in_its_group_and_trains_no_token():
    group = group0()
    failed = msgspec.structs.replace(group.samples[1], stats=EpisodeStats(turns=2, env_error=True))
    seqs = build_sequences([msgspec.structs.replace(group, samples=[group.samples[0], failed])], AlgoConfig())
    kept = build_sequences([group], AlgoConfig())
    assert not seqs[1].loss_mask.any() and kept[1].loss_mask.any()
    assert not seqs[1].advantages.any() and kept[0].advantages[kept[0].loss_mask].gt(0).all()
    assert not seqs[0].advantages.any(), "alone in its group: nothing to compare its return with"
    metrics = batch_metrics([Trajectory(group_id=0, prompt_ids=group.prompt_ids, samples=[failed], data_index=0)],
                            0, 1.0)
    assert metrics["rollout/env_errors"] == 1.0 and batch_metrics([group], 0, 1.0)["rollout/env_errors"] == 0.0


def _group(g: int, rewards: list[float], failed: int | None = None, empty: bool = False) -> Trajectory:
    """Group ``g`` of two-token samples; sample ``failed``: ended by its environment, or (``empty``)
    an episode with no model turn."""
    def sample(i: int, r: float) -> Sample:
        n = 0 if empty and i == failed else 2
        stats = (EpisodeStats(turns=0) if empty else EpisodeStats(env_error=True)) if i == failed else None
        return Sample(index=i, seed=i, output_ids=Array.of([7, 8][:n], "int32"),
                      behav_logprobs=Array.of([-1.0, -1.0][:n], "float32"), versions=Array.of([0, 0][:n], "int32"),
                      finish_reason="stop", reward=r, stats=stats)

    samples = [sample(i, r) for i, r in enumerate(rewards)]
    return Trajectory(group_id=g, prompt_ids=Array.of([1, 2], "int32"), samples=samples, data_index=g)


@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_failed_or_empty_episodes_return_enters_no_statistics(batch_norm, empty):
    # an empty episode (no model turn: an agent that made no call) moved its group's mean and std
    first = lambda seqs: [float(q.advantages[q.loss_mask][0]) if q.loss_mask.any() else 0.0 for q in seqs]
    got = first(build_sequences([_group(0, [5.0, -5.0, 0.0, 1.0], failed=2, empty=empty),
                                 _group(1, [2.0, 0.0, 1.0, 3.0])], AlgoConfig(batch_norm=batch_norm)))
    if not batch_norm:  # group 0 normalised over its three other samples; group 1 as it is alone
        kept = group_advantages(torch.tensor([5.0, -5.0, 1.0]), 3).tolist()
        alone = first(build_sequences([_group(1, [2.0, 0.0, 1.0, 3.0])], AlgoConfig()))
        assert got == pytest.approx([*kept[:2], 0.0, kept[2], *alone], abs=0, rel=0)
    else:  # the batch's statistics over the seven others: mean 0, std 1 among them
        others = torch.tensor(got[:2] + got[3:])
        assert got[2] == 0.0 and abs(others.mean()) < 1e-6 and abs(others.std(unbiased=False) - 1) < 1e-4


def test_a_failed_episodes_turn_rewards_enter_no_statistics():
    group = group0()
    failed = msgspec.structs.replace(group.samples[0], index=2, reward=-9.0, turn_rewards=Array.of([40.0, -7.0], "float32"),
                                     stats=EpisodeStats(turns=2, env_error=True))
    three = msgspec.structs.replace(group, samples=[*group.samples, failed])
    for mode in ("reward_to_go", "sum"):
        got = build_sequences([three], AlgoConfig(turn_rewards=mode))
        want = build_sequences([group], AlgoConfig(turn_rewards=mode))
        assert all(torch.equal(g.advantages, w.advantages) for g, w in zip(got[:2], want)), mode
        assert not got[2].advantages.any() and not got[2].loss_mask.any()


def test_env_error_is_off_the_wire_unless_set():
    assert msgspec.msgpack.encode(EpisodeStats(turns=2)) == msgspec.msgpack.encode({"turns": 2})
    wire = msgspec.msgpack.encode(EpisodeStats(turns=2, env_error=True))
    assert msgspec.msgpack.decode(wire, type=EpisodeStats).env_error


def test_on_env_error_is_checked_at_load():
    with pytest.raises(ValueError, match=r"'rollout.on_env_error' = 'skip'.*choose one of \['raise', 'zero'\]"):
        load_config(None, ["rollout.on_env_error=skip"])
    with pytest.raises(ValueError, match=r"rollout.on_env_error='zero' applies to rollout.workflow's Env or run"):
        load_config(None, ["rollout.on_env_error=zero"])
    cfg = load_config(None, ["rollout.on_env_error=zero", "rollout.workflow=examples.workflows.retry_agent:run"])
    assert cfg.rollout.on_env_error == "zero"
