"""The generated arithmetic task: deterministic, disjoint splits, correct golds, registered."""

from __future__ import annotations

import pytest

from areal_async.config import DataConfig
from areal_async.data import TASKS, arith
from areal_async.reward.math import math_reward


def test_generation_is_a_pure_function_of_the_seed():
    assert arith.generate_splits(0) == arith.generate_splits(0)
    assert arith.generate_splits(0)["train"] != arith.generate_splits(1)["train"]


def test_splits_are_disjoint_and_cover_every_problem_once():
    s = arith.generate_splits(0)
    keys = {name: [(x.kind, x.operands) for x in items] for name, items in s.items()}
    assert len(keys["test"]) == 3 * arith.TEST_PER_KIND
    assert len(keys["demos"]) == 3 * arith.DEMOS_PER_KIND
    everything = keys["train"] + keys["test"] + keys["demos"]
    assert len(everything) == len(set(everything)) == 900 + 820 + 1000


def test_test_prefix_interleaves_kinds():
    test = arith.generate_splits(0)["test"]
    assert [x.kind for x in test[:6]] == ["add", "sub", "sum3"] * 2


@pytest.mark.parametrize(
    "item, gold, question",
    [
        (arith.ArithItem("add", (17, 25)), "42", "What is 17 + 25?"),
        (arith.ArithItem("sub", (31, 9)), "22", "What is 31 - 9?"),
        (arith.ArithItem("sum3", (7, 8, 9)), "24", "What is 7 + 8 + 9?"),
    ],
)
def test_golds_by_hand(item, gold, question):
    task = arith.ArithTask([item])
    assert task.gold(0) == gold
    assert task.messages(0)[-1]["content"].startswith(question)


def test_every_gold_matches_python_arithmetic_and_is_scored_right_by_its_demo():
    for item in arith.generate_splits(0)["train"][:300]:
        expected = eval(item.expression)  # noqa: S307 — digits and +/- only
        task = arith.ArithTask([item])
        assert task.gold(0) == str(expected)
        assert math_reward(item.demo_answer(), task.gold(0)) == 1.0
        assert math_reward(f"\\boxed{{{expected + 1}}}", task.gold(0)) == 0.0


def test_loader_few_shot_demos_are_earlier_turns():
    task = TASKS["arith"](DataConfig(task="arith", few_shot=3), "train")
    msgs = task.messages(0)
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert all(m["content"].endswith("}.") and "\\boxed{" in m["content"]
               for m in msgs if m["role"] == "assistant")
    assert len(task) == 2720 - 3 * (arith.TEST_PER_KIND + arith.DEMOS_PER_KIND)


def test_loader_rejects_bad_split_and_few_shot():
    with pytest.raises(ValueError, match="split 'dev'"):
        arith.load_arith(DataConfig(task="arith"), "dev")
    with pytest.raises(ValueError, match="data.few_shot must be in 0..12"):
        arith.load_arith(DataConfig(task="arith", few_shot=13), "train")
