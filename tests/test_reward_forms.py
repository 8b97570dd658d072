"""Reward functions of both forms, told apart by their signature once, and the keyword form
called through the real process pool with exactly the arguments it names."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_async.config import RewardConfig
from areal_async.reward.fn import KEYWORDS, keywords, resolve_reward_fn
from areal_async.reward.math import math_reward
from areal_async.reward.pool import RewardPool
from tests.support import reward_forms
from tests.support.parity_reward import even_length


def answer_named(response, answer):
    return 1.0


def other_names(completion, ground_truth, bonus=0.0):
    return 1.0


def keyword_only(response, *, item, extra=None):
    return 1.0


def just_args(*args):
    return 1.0


def wrapper(*args, **kwargs):
    return 1.0


def one(response):
    return 1.0


def three(a, b, c):
    return 1.0


def nothing():
    return 1.0


def positional_only(response, answer, /):
    return 1.0


@pytest.mark.parametrize("fn,form", [
    (math_reward, None),                         # (response, gold): the answer form
    (even_length, None),
    (other_names, None),                         # any two names but the keywords'
    (just_args, None),
    (positional_only, None),                     # cannot be called by keyword
    (answer_named, ("response", "answer")),      # both forms, one meaning: called by keyword
    (keyword_only, ("response", "item")),
    (reward_forms.record, KEYWORDS),
    (reward_forms.record_some, ("response", "item")),
    (reward_forms.record_all, KEYWORDS),         # **kwargs: all four
    (one, ("response",)),
])
def test_the_form_is_read_from_the_signature(fn, form):
    assert keywords(fn) == form


@pytest.mark.parametrize("fn", [reward_forms.prompts_completions, wrapper, three, nothing])
def test_a_signature_of_neither_form_is_refused_at_resolution(fn):
    with pytest.raises(ValueError, match=r"fits neither form: fn\(response, gold\) .* named from response, "
                                         r"answer, messages, item"):
        resolve_reward_fn(fn)


def test_the_launch_check_reads_the_form_of_an_import_path():
    with pytest.raises(ValueError, match=r"tests\.support\.reward_forms:prompts_completions\(prompts, completions, "
                                         r"\*\*kwargs\) fits neither form"):
        resolve_reward_fn("tests.support.reward_forms:prompts_completions")


PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
ROW = {"prompt": "2+2?", "answer": "4", "target": "4", "level": 3, "tags": ["a", "b"]}


def scored(out, fn, **score_kw):
    """Score one response with ``fn`` through a one-process pool; the calls it recorded in ``out``."""
    item = {**ROW, "record_to": str(out)}

    async def body(pool):
        return await pool.score(fn, "\\boxed{4}", "4", **score_kw, item=item)

    with RewardPool(RewardConfig(num_procs=1, timeout_s=30.0)) as pool:
        result = asyncio.run(body(pool))
    return result, [json.loads(x) for x in out.read_text().splitlines()], item


def test_the_keyword_form_gets_what_it_names_through_the_pool(tmp_path):
    result, calls, item = scored(tmp_path / "a.jsonl", reward_forms.record, prompt=PROMPT)
    assert result.correct and not result.error
    assert calls == [{"response": "\\boxed{4}", "answer": "4", "item": item,
                      "messages": PROMPT + [{"role": "assistant", "content": "\\boxed{4}"}]}]
    _, calls, _ = scored(tmp_path / "b.jsonl", reward_forms.record_some, prompt=PROMPT)
    assert sorted(calls[0]) == ["item", "response"]  # nothing it does not name crosses
    _, calls, _ = scored(tmp_path / "c.jsonl", "tests.support.reward_forms:record_all")  # by path; no prompt
    assert sorted(calls[0]) == sorted(KEYWORDS)
    assert calls[0]["messages"] == [{"role": "assistant", "content": "\\boxed{4}"}]


def test_reward_fn_in_the_config_replaces_the_tasks_and_the_item_decides(tmp_path):
    out = tmp_path / "calls.jsonl"
    cfg = RewardConfig(fn="tests.support.reward_forms:record", num_procs=1, timeout_s=30.0)

    async def body(pool):
        return [await pool.score("math", "\\boxed{4}", "4", item={**ROW, "target": t, "record_to": str(out)})
                for t in ("4", "5")]

    with RewardPool(cfg) as pool:
        right, wrong = asyncio.run(body(pool))
    assert (right.correct, wrong.correct) == (True, False)  # math would score both right
    assert len(out.read_text().splitlines()) == 2
