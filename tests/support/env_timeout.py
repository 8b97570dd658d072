"""Episodes for ``tests/test_env_timeout.py``: ``run_episode`` runs one ``EnvWorkflow`` episode
(g3-s1) whose turns a stand-in client answers with two tokens each (only the workflow, the episode
and the tokenizer are real).

    python -m tests.support.env_timeout MODEL_DIR BlockingEnv|BlockingAsyncEnv

runs that env with ``env_timeout_s`` 0.3: the watchdog is expected to end the process.
"""

from __future__ import annotations

import asyncio
import sys
import time

from transformers import AutoTokenizer

from areal_async.inference.client import GenResult
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EnvWorkflow, EpisodeItem
from areal_async.types import Sample

QUESTION = [{"role": "user", "content": "How many apples are left?"}]


class StubClient:
    """Every turn: two tokens, cut by length."""

    urls = ["stub"]

    async def generate(self, input_ids, sampling, rid, server=None, session=None):
        return GenResult([5, 6], [-1.0, -1.0], [0, 0], "length")


def run_episode(model_dir, env_class, env_timeout_s: float, bound_s: float | None = None) -> Sample:
    """Episode g3-s1 of ``env_class`` (at most 4 turns) under ``env_timeout_s``; ``bound_s``: the
    test's own bound on the whole episode (past it: the builtin ``TimeoutError``)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    ep = Episode(StubClient(), tok, tok.decode, 3, 1, 7, prompt, QUESTION, {}, server=0, max_new_tokens=2,
                 max_turns=4)
    return asyncio.run(asyncio.wait_for(EnvWorkflow(env_class, env_timeout_s)(ep, EpisodeItem(QUESTION, "4")),
                                        bound_s))


class BlockingEnv:
    """Turn 0 answers; turn 1 blocks the event loop for an hour."""

    def reset(self, item, seed):
        return None

    def step(self, action):
        if action.turn == 1:
            time.sleep(3600)
        return [{"role": "user", "content": "more"}], 0.0, False


class BlockingAsyncEnv:
    """An ``async`` step that blocks the event loop in turn 1 (a synchronous call inside)."""

    def reset(self, item, seed):
        return None

    async def step(self, action):
        await asyncio.sleep(0)
        if action.turn == 1:
            time.sleep(3600)
        return [{"role": "user", "content": "more"}], 0.0, False


if __name__ == "__main__":
    run_episode(sys.argv[1], globals()[sys.argv[2]], 0.3)
