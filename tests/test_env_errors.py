"""Observation ids outside the vocabulary, against a scripted client (``tests/support/scripted.py``)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from areal_async.model.source import model_vocab_size
from areal_async.rollout.workflows import EnvWorkflow
from tests.support.scripted import run_workflow, scripted_episode


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids_env(first, later):
    class IdsEnv:
        def reset(self, item, seed):
            return first

        def step(self, action):
            return later, 0.0, action.turn == 1

    return IdsEnv


def test_an_observation_id_outside_the_vocabulary_is_named(tok):
    # it reached the engine: on a GPU a device-side assert that named neither the env nor the id
    n = len(tok)
    prompt = tok.encode("Hi", add_special_tokens=False)
    with pytest.raises(ValueError, match=rf"IdsEnv\.reset gave the observation token id {n} in episode g0-s2, "
                                         rf"outside the vocabulary \[0, {n}\)"):
        run_workflow(EnvWorkflow(ids_env(prompt + [n], None)), scripted_episode(tok))
    with pytest.raises(ValueError, match=rf"IdsEnv\.step gave the observation token id -1 in episode g0-s2, "
                                         rf"turn 0, outside the vocabulary \[0, {n}\)"):
        run_workflow(EnvWorkflow(ids_env(None, [5, -1])), scripted_episode(tok))
    # the model's embedding may have more rows than the tokenizer has tokens: those ids are the engine's
    sample = run_workflow(EnvWorkflow(ids_env(None, [n + 3]), vocab_size=n + 4), scripted_episode(tok))
    assert n + 3 in sample.output_ids.tolist()


def test_the_vocabulary_bound_is_the_models_embedding_rows(tiny_model_dir, tok, tmp_path):
    assert model_vocab_size(tiny_model_dir) == len(tok)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert model_vocab_size(tmp_path) == 151936 and model_vocab_size(tmp_path / "none") == 0
