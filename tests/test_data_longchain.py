"""The generated running-sum task: deterministic, disjoint splits, golds and steps by hand, registered."""

from __future__ import annotations

import pytest

from areal_async.config import DataConfig
from areal_async.data import TASKS, longchain
from areal_async.reward.math import math_reward


def test_generation_is_a_pure_function_of_the_seed():
    assert longchain.generate_splits(0) == longchain.generate_splits(0)
    assert longchain.generate_splits(0)["train"] != longchain.generate_splits(1)["train"]


def test_splits_are_disjoint_and_sized():
    s = longchain.generate_splits(0)
    keys = {name: [x.numbers for x in items] for name, items in s.items()}
    assert len(keys["test"]) == 3 * longchain.TEST_PER_KIND
    assert len(keys["demos"]) == 3 * longchain.DEMOS_PER_KIND
    everything = keys["train"] + keys["test"] + keys["demos"]
    assert len(everything) == len(set(everything))


def test_lengths_and_addends_follow_the_kind():
    for item in longchain.generate_splits(0)["train"][:600]:
        lo, hi = longchain.KINDS[item.kind]
        assert lo <= len(item.numbers) <= hi
        assert all(1 <= x <= longchain.MAX_ADDEND for x in item.numbers)


def test_test_prefix_interleaves_kinds():
    test = longchain.generate_splits(0)["test"]
    assert [x.kind for x in test[:6]] == ["short", "medium", "long"] * 2


def test_gold_and_steps_by_hand():
    # running totals of 4, 3, 7, 9: 4+3 = 7, 7+7 = 14, 14+9 = 23
    item = longchain.ChainItem("short", (4, 3, 7, 9))
    task = longchain.LongChainTask([item])
    assert task.gold(0) == "23"
    assert item.steps() == ["4 + 3 = 7", "7 + 7 = 14", "14 + 9 = 23"]
    assert item.demo_answer() == "4 + 3 = 7\n7 + 7 = 14\n14 + 9 = 23\nThe answer is \\boxed{23}."
    assert task.messages(0)[-1]["content"] == (
        "Add these numbers one at a time, writing every running total: 4, 3, 7, 9\n"
        "Put the final answer in \\boxed{}.")


def test_every_gold_is_the_sum_and_its_demo_scores():
    for item in longchain.generate_splits(0)["test"]:
        task = longchain.LongChainTask([item])
        assert task.gold(0) == str(sum(item.numbers))
        assert item.steps()[-1].endswith(f"= {sum(item.numbers)}")
        assert math_reward(item.demo_answer(), task.gold(0)) == 1.0
        assert math_reward(f"\\boxed{{{sum(item.numbers) + 1}}}", task.gold(0)) == 0.0


def test_loader_demo_is_an_earlier_turn():
    task = TASKS["longchain"](DataConfig(task="longchain", few_shot=1), "test")
    msgs = task.messages(0)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"].endswith("}.") and "\\boxed{" in msgs[2]["content"]
    assert len(task) == 3 * longchain.TEST_PER_KIND


def test_loader_rejects_bad_split_and_few_shot():
    with pytest.raises(ValueError, match="split 'dev'"):
        longchain.load_longchain(DataConfig(task="longchain"), "dev")
    with pytest.raises(ValueError, match="data.few_shot must be in 0..6"):
        longchain.load_longchain(DataConfig(task="longchain", few_shot=7), "train")
