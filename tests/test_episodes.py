"""Episodes against the embedded engine (tiny model, in process): the default workflow, an ``Env``,
an OpenAI-client workflow, token identity on every turn, and the workflow loader's errors.

Token identity: a client that records every ``generate`` call's input ids checks, for every turn
of every episode, that the trainer's sequence is exactly those ids followed by the ids the engine
returned, with the loss mask, log-probs and versions aligned token for token.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from areal_async.config import RewardConfig
from areal_async.inference.client import InferenceClient
from areal_async.reward.pool import RewardPool
from areal_async.rollout.episode import Episode, turn_seed
from areal_async.rollout.workflows import EnvWorkflow, EpisodeItem, OpenAIWorkflow, ToolLoop, load_workflow
from areal_async.types import sample_seed

torch.set_num_threads(1)

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
QUESTION = [{"role": "user", "content": "How many apples are left?"}]


class Recording(InferenceClient):
    """The real client, keeping each call's (input ids, sampling, output ids)."""

    calls: list

    async def generate(self, input_ids, sampling, rid, server=None, session=None):
        out = await super().generate(input_ids, sampling, rid, server=server, session=session)
        self.calls.append((rid, list(input_ids), dict(sampling), list(out.output_ids)))
        return out


@contextlib.asynccontextmanager
async def engine_client(model_dir):
    from areal_async.embedded.http_server import InferenceServer, serve
    from areal_async.embedded.loading import load_engine

    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", 4, 512, deterministic=True)
    async with serve(InferenceServer(engine, tokenizer, str(model_dir))) as url, Recording([url]) as client:
        client.calls = []
        yield client


def episode(client, tok, g=3, i=1, max_turns=4, max_new_tokens=6):
    prompt = tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    sampling = {**SAMPLING, "stop_token_ids": [tok.eos_token_id]}
    return Episode(client, tok, lambda ids: tok.decode(ids, skip_special_tokens=True), g, i, sample_seed(5, g, i),
                   prompt, QUESTION, sampling, server=0, max_new_tokens=max_new_tokens, max_turns=max_turns)


def item():
    return EpisodeItem(QUESTION, "4")


def assert_token_identity(sample, prompt, calls):
    """Every call's input is the sequence so far; its output sits right after it, mask 1 there."""
    seq = prompt + sample.output_ids.tolist()
    produced = np.zeros(len(seq), dtype=bool)
    for rid, inputs, _, outputs in calls:
        n = len(inputs)
        assert seq[:n] == inputs, f"{rid}: the engine consumed other ids than the trainer's sequence"
        assert seq[n:n + len(outputs)] == outputs, f"{rid}: the engine's ids are not the trainer's"
        produced[n:n + len(outputs)] = True
    assert (produced[len(prompt):] == sample.sampled()).all(), "the loss mask is not the engine's sampled tokens"
    sampled = sample.sampled()
    assert (sample.versions.numpy()[~sampled] == -1).all() and (sample.behav_logprobs.numpy()[~sampled] == 0).all()
    assert sampled.sum() == sum(len(out) for *_, out in calls)


def test_the_default_episode_is_one_generate_call_as_the_single_turn_rollout_made_it(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with engine_client(tiny_model_dir) as client:
            with RewardPool(RewardConfig(num_procs=1)) as rewards:
                ep = episode(client, tok)
                sample = await ToolLoop(rewards, "math")(ep, item())
                direct = await client.generate(ep.prompt_ids, {**ep._sampling, "max_new_tokens": 6,
                                                               "sampling_seed": sample_seed(5, 3, 1)}, rid="again")
            return sample, direct, client.calls

    sample, direct, calls = asyncio.run(main())
    assert [c[0] for c in calls] == ["g3-s1", "again"]
    assert calls[0][2]["sampling_seed"] == sample_seed(5, 3, 1) and "stop" not in calls[0][2]
    assert sample.output_ids.tolist() == direct.output_ids
    assert sample.behav_logprobs.tolist() == np.asarray(direct.logprobs, dtype=np.float32).tolist()
    assert (sample.loss_mask, sample.turn_spans, sample.stats, sample.segments) == (None, None, None, [])
    assert sample.index == 1 and sample.seed == sample_seed(5, 3, 1) and not sample.correct


class CountdownEnv:
    """Three model turns: after each, a user message says how many remain; per-turn rewards."""

    def reset(self, item, seed):
        self.left = 3
        return None

    async def step(self, action):
        self.left -= 1
        await asyncio.sleep(0)
        return [{"role": "user", "content": f"{self.left} more"}], float(len(action.ids) % 2), self.left == 0


def test_an_env_episode_keeps_every_turns_tokens_as_the_engine_consumed_and_produced_them(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with engine_client(tiny_model_dir) as client:
            ep = episode(client, tok)
            sample = await EnvWorkflow(CountdownEnv)(ep, item())
            return ep, sample, client.calls

    ep, sample, calls = asyncio.run(main())
    assert [c[0] for c in calls] == ["g3-s1", "g3-s1-t1", "g3-s1-t2"]
    assert [c[2]["sampling_seed"] for c in calls] == [turn_seed(sample_seed(5, 3, 1), t) for t in range(3)]
    assert_token_identity(sample, ep.prompt_ids, calls)
    spans = sample.turn_spans.tolist()
    out = sample.output_ids.tolist()
    assert [out[a:b] for a, b in spans] == [c[3] for c in calls]
    assert sample.turn_rewards.tolist() == [float(len(c[3]) % 2) for c in calls]
    assert sample.stats.turns == 3 and not sample.stats.truncated
    between = tok.decode(out[spans[0][1]:spans[1][0]])
    assert "2 more" in between and between.endswith("<|im_start|>assistant\n"), between


def test_an_episode_over_max_turns_is_truncated(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with engine_client(tiny_model_dir) as client:
            ep = episode(client, tok, max_turns=2)
            return await EnvWorkflow(CountdownEnv)(ep, item())

    sample = asyncio.run(main())
    assert sample.stats.turns == 2 and sample.stats.truncated and len(sample.turn_rewards.tolist()) == 2


class FloodEnv:
    """A tool result longer than the servers' context (512 tokens) after the first turn."""

    def reset(self, item, seed):
        return None

    def step(self, action):
        return [{"role": "tool", "content": "apple " * 600}], 1.0, False


def test_an_observation_that_fills_the_context_truncates_the_episode(tiny_model_dir):
    # the next turn's request was refused by the server (HTTP 400: prompt + max_new_tokens exceeds
    # max_seq_len) and the worker died on it, three times, then the job
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with engine_client(tiny_model_dir) as client:
            ep = episode(client, tok)
            ep.max_seq_len = 512  # the engine's
            return await EnvWorkflow(FloodEnv)(ep, item()), client.calls

    sample, calls = asyncio.run(main())
    assert len(calls) == 1 and sample.stats.turns == 1 and sample.stats.truncated
    assert sample.turn_rewards.tolist() == [1.0]


@pytest.mark.parametrize("reward, error, words", [
    (float("nan"), ValueError, "gave the reward nan in episode g3-s1, turn 0; a reward must be finite"),
    ("0.5", TypeError, "gave the reward '0.5' (str) in episode g3-s1, turn 0; a reward is a number"),
    (None, TypeError, "gave the reward None (NoneType)"),
])
def test_an_env_reward_that_is_no_finite_number_is_named(tiny_model_dir, reward, error, words):
    # a NaN reward trained nothing (every loss NaN, the update skipped) and the job ended "done";
    # a string was read as a number
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class BadReward:
        def reset(self, item, seed):
            return None

        def step(self, action):
            return None, reward, True

    async def main():
        async with engine_client(tiny_model_dir) as client:
            return await EnvWorkflow(BadReward)(episode(client, tok), item())

    with pytest.raises(error, match=f"BadReward.step {words}".replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(main())


async def two_calls_then_an_edit(item, client):
    """Two calls that extend the conversation, then one whose history is edited: a new sequence."""
    messages = list(item.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    edited = messages[:1] + [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    return {0: 1.0, 2: -0.5} if second.choices[0].finish_reason else 0.0


def test_an_openai_client_workflow_records_its_calls_and_an_edited_history_starts_a_new_sequence(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with engine_client(tiny_model_dir) as client:
            ep = episode(client, tok)
            sample = await OpenAIWorkflow(two_calls_then_an_edit, 1.0, 1.0)(ep, item())
            return ep, sample, client.calls

    ep, sample, calls = asyncio.run(main())
    assert [c[0] for c in calls] == ["g3-s1", "g3-s1-t1", "g3-s1-t2"]
    assert_token_identity(sample, ep.prompt_ids, calls[:2])
    [segment] = sample.segments
    assert segment.prompt_ids.tolist() == calls[2][1], "the new sequence's prompt is what the engine consumed"
    assert segment.output_ids.tolist() == calls[2][3] and segment.loss_mask.tolist() == [1] * len(calls[2][3])
    assert sample.turn_rewards.tolist() == [1.0, 0.0, -0.5] and sample.reward == 0.0
    assert len(sample.turn_spans.tolist()) == 2 and len(segment.turn_spans.tolist()) == 1


def test_the_recording_endpoint_refuses_what_would_break_the_record(tiny_model_dir):
    import openai

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = {}

    async def hot(item, client):
        with pytest.raises(openai.BadRequestError, match="temperature=0.5: an episode samples with the run's"):
            await client.chat.completions.create(model="p", messages=item.messages, temperature=0.5)
        calls = [client.chat.completions.create(model="p", messages=item.messages, max_tokens=3) for _ in range(2)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        seen["errors"] = [str(r) for r in results if isinstance(r, Exception)]
        return 1.0

    async def main():
        async with engine_client(tiny_model_dir) as client:
            return await OpenAIWorkflow(hot, 1.0, 1.0)(episode(client, tok), item())

    sample = asyncio.run(main())
    assert len(seen["errors"]) == 1 and "one at a time" in seen["errors"][0]
    assert sample.reward == 1.0 and sample.correct


def test_load_workflow_reads_the_shape_and_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "my_flows.py").write_text(
        "class E:\n    def reset(self, item, seed): return None\n    def step(self, action): return None, 0.0, True\n"
        "async def run(item, client): return 0.0\n"
        "def sync_run(item, client): return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_workflow("my_flows:E", 1.0, 1.0), EnvWorkflow)
    assert isinstance(load_workflow("my_flows:run", 1.0, 1.0), OpenAIWorkflow)
    with pytest.raises(ValueError, match="neither an Env class"):
        load_workflow("my_flows:sync_run", 1.0, 1.0)
    with pytest.raises(ValueError, match="is not 'package.module:object'"):
        load_workflow("my_flows.run", 1.0, 1.0)
    with pytest.raises(ValueError, match="cannot be imported"):
        load_workflow("my_flows:missing", 1.0, 1.0)


def test_versions_and_masks_stay_aligned_over_an_episode_interrupted_by_two_weight_updates(tiny_model_dir, tmp_path):
    # The environment has the server load new weights (a perturbed copy, versions 1 and 2) after
    # turns 0 and 1: each turn's tokens carry the version that sampled them, -1 between turns, and
    # the episode's staleness counts from its oldest sampled token (version 0).
    from tests.support.models import perturbed

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    paths = []
    for v in (1, 2):
        model = perturbed(tiny_model_dir, seed=v)
        model.save_pretrained(tmp_path / f"v{v}")
        tok.save_pretrained(tmp_path / f"v{v}")
        paths.append(str(tmp_path / f"v{v}"))

    class UpdatingEnv:
        def reset(self, item, seed):
            return None

        async def step(self, action):
            if action.turn < 2:
                await held["client"].update_weights_from_disk(0, paths[action.turn], action.turn + 1)
            return [{"role": "user", "content": "go on"}], 0.0, action.turn == 2

    held = {}

    async def main():
        async with engine_client(tiny_model_dir) as c:
            held["client"] = c
            ep = episode(c, tok)
            return ep, await EnvWorkflow(UpdatingEnv)(ep, item()), c.calls

    ep, sample, calls = asyncio.run(main())
    assert_token_identity(sample, ep.prompt_ids, calls)
    versions = sample.versions.tolist()
    for t, (a, b) in enumerate(sample.turn_spans.tolist()):
        assert versions[a:b] == [t] * (b - a), f"turn {t}'s tokens are not all of version {t}"
    outside = [v for k, v in enumerate(versions) if not sample.sampled()[k]]
    assert outside and set(outside) == {-1}
    assert sample.oldest_version() == 0 and sample.sampled_versions().max() == 2
