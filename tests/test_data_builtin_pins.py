"""The built-in tasks' prompts and gold answers, pinned: a digest of every item's chat messages
and gold, per task, split and few-shot count, recorded from the tasks as they were before they
became instances of the generic ``file`` machinery. Same messages, same tokenizer → same prompt
token ids, so a changed digest means changed prompts, token ids and trajectories."""

from __future__ import annotations

import hashlib
import json

import pytest

from areal_async.config import DataConfig
from areal_async.data import load_task

# (task, few_shot, split) -> (items, sha256 prefix of the JSON of [messages(i), gold(i)] for all i)
PINS = {
    ("gsm8k", 0, "train"): (7473, "9ab0a6ebf85a2630"),
    ("gsm8k", 0, "test"): (1319, "6c1e33e21ce3965f"),
    ("gsm8k", 2, "train"): (7471, "260bca46c1d1229b"),
    ("gsm8k", 2, "test"): (1319, "dea3966addb8eb13"),
    ("arith", 0, "train"): (2408, "fd087b2d76e7a6ed"),
    ("arith", 0, "test"): (300, "195c6c0f6ddc5c10"),
    ("arith", 3, "train"): (2408, "d2b630d878236536"),
    ("arith", 3, "test"): (300, "e53365414206ff41"),
}


def digest(task) -> tuple[int, str]:
    h = hashlib.sha256()
    for i in range(len(task)):
        h.update(json.dumps([task.messages(i), task.gold(i)], sort_keys=True).encode())
    return len(task), h.hexdigest()[:16]


@pytest.mark.parametrize("key", sorted(PINS), ids=lambda k: f"{k[0]}-{k[1]}shot-{k[2]}")
def test_builtin_task_prompts_and_golds_are_unchanged(key):
    name, few_shot, split = key
    assert digest(load_task(DataConfig(task=name, few_shot=few_shot), split)) == PINS[key]


def test_the_digest_sees_one_changed_character():
    task = load_task(DataConfig(task="arith"), "test")

    class Edited:
        def __len__(self):
            return len(task)

        def messages(self, i):
            m = task.messages(i)
            return m[:-1] + [{**m[-1], "content": m[-1]["content"] + " "}] if i == 7 else m

        def gold(self, i):
            return task.gold(i)

    assert digest(Edited()) != PINS[("arith", 0, "test")]
