"""Graded rewards (``reward.graded``) and the running-sum step credit ``longchain_steps``."""

from __future__ import annotations

import asyncio
import math

import pytest

from areal_async.config import RewardConfig, load_config
from areal_async.data import longchain
from areal_async.reward.pool import REWARD_FNS, RewardPool, RewardResult
from areal_async.reward.running_sum import chain_steps, longchain_steps


def value_of_gold(response: str, gold: str) -> float:
    """Returns the gold read as a float: a test picks the value the pool receives."""
    return float(gold)


# 4, 3, 7: two steps (4 + 3 = 7, 7 + 7 = 14), total 14, so v counts in thirds.
ITEM = {"numbers": [4, 3, 7]}
RIGHT = "4 + 3 = 7\n7 + 7 = 14\nThe answer is \\boxed{14}."


@pytest.mark.parametrize("response,expected", [
    (RIGHT, 3 / 3),                                                    # both steps and the total
    ("4 + 3 = 7\n7 + 7 = 15\nThe answer is \\boxed{15}.", 1 / 3),      # right until line 2
    ("4 + 3 = 8\n8 + 7 = 15\n\\boxed{15}", 0 / 3),                     # the first line wrong
    ("4 + 3 = 8\n7 + 7 = 14\n\\boxed{14}", 0 / 3),                     # a wrong line stops the count
    ("4 + 3 = 7\n7 + 7 = 14\nThe answer is \\boxed{15}.", 2 / 3),      # wrong boxed total
    ("4 + 3 = 7\n7 + 7 = 14\nThe answer is 14.", 2 / 3),               # no box
    ("  4+3 =7 \n\n\t7 +  7=14\nThe answer is \\boxed{ 14 }.", 3 / 3),  # whitespace, a blank line
    ("", 0.0),
    ("Let us add.\n4 + 3 = 7\n7 + 7 = 14\n\\boxed{14}", 0 / 3),         # prose first stops the count
    ("\\boxed{14}", 0 / 3),                                            # a right total, no steps
    ("4 + 3 = 7\n7 + 7 = 14\n14 + 1 = 15\n\\boxed{14}", 3 / 3),         # lines past the steps unread
])
def test_step_credit_by_hand(response, expected):
    assert longchain_steps(response, ITEM) == expected


def test_step_credit_of_the_task_demo_answers_is_full():
    items = longchain.generate_splits(0)["test"][:6]
    for x in items:
        assert x.steps() == chain_steps(x.numbers)
        assert longchain_steps(x.demo_answer(), {"numbers": list(x.numbers)}) == 1.0
        # one wrong step in the middle: credit for the lines before it only
        lines = x.demo_answer().splitlines()
        k = len(lines) // 2
        lines[k] = lines[k].replace("=", "= 1")
        assert longchain_steps("\n".join(lines), {"numbers": list(x.numbers)}) == k / len(x.numbers)


def test_step_credit_needs_the_numbers():
    with pytest.raises(ValueError, match=r"item\['numbers'\], a list of ints, got None .*'answer'.*"
                                         r"data.task: longchain"):
        longchain_steps(RIGHT, {"answer": 14})


def test_registered_and_configured():
    assert REWARD_FNS["longchain_steps"] is longchain_steps
    cfg = load_config("configs/longchain_steps_gpu.yaml")
    assert (cfg.reward.fn, cfg.reward.graded, cfg.data.task) == ("longchain_steps", True, "longchain")
    assert RewardConfig().graded is False


def test_graded_pool_scales_v_and_refuses_values_outside_0_1(capsys):
    cfg = RewardConfig(correct=5.0, wrong=-5.0, graded=True, timeout_s=30.0, num_procs=1)

    async def body(pool: RewardPool):
        # reward = wrong + v * (correct - wrong) = -5 + 10 v; correct only at v = 1
        assert await pool.score(value_of_gold, "", "0") == RewardResult(-5.0, False, False, False)
        assert await pool.score(value_of_gold, "", "0.3") == RewardResult(-2.0, False, False, False)
        assert await pool.score(value_of_gold, "", "0.7") == RewardResult(2.0, False, False, False)
        assert await pool.score(value_of_gold, "", "1") == RewardResult(5.0, True, False, False)
        assert await pool.score(value_of_gold, "\\boxed{1}", "1") == RewardResult(5.0, True, False, True)
        for bad in ("1.5", "-0.1", "nan"):  # an error: scored as wrong (v = 0) and counted
            assert await pool.score(value_of_gold, "", bad) == RewardResult(-5.0, False, True, False)
        # the step credit through the registry and the item: v = 1/3 -> -5 + (1/3) * 10 = -1.67
        third = await pool.score("longchain_steps", "4 + 3 = 7\n7 + 7 = 15\n\\boxed{15}", "14", item=ITEM)
        assert third == RewardResult(-5.0 + (1 / 3) * 10.0, False, False, True)
        assert third.reward == pytest.approx(-5 / 3)
        assert await pool.score("longchain_steps", RIGHT, "14", item=ITEM) == RewardResult(5.0, True, False, True)
        assert pool.stats() == {"reward/calls": 10, "reward/errors": 3, "reward/timeouts": 0,
                                "reward/restarts": 0}

    with RewardPool(cfg) as pool:
        asyncio.run(body(pool))
    logged = capsys.readouterr().out
    assert logged.count("outside [0, 1]") == 1, logged  # the first one only
    assert "tests.test_reward_graded:value_of_gold returned 1.5, outside [0, 1], with reward.graded on" in logged
    assert "turn reward.graded off" in logged


def test_pool_off_is_pass_fail_as_before():
    cfg = RewardConfig(correct=5.0, wrong=-5.0, timeout_s=30.0, num_procs=1)
    assert not cfg.graded

    async def body(pool: RewardPool):
        assert await pool.score(value_of_gold, "", "0.3") == RewardResult(-5.0, False, False, False)
        assert await pool.score(value_of_gold, "", "0.51") == RewardResult(5.0, True, False, False)
        assert await pool.score(value_of_gold, "", "1.5") == RewardResult(5.0, True, False, False)
        assert await pool.score(value_of_gold, "", "nan") == RewardResult(-5.0, False, False, False)
        assert (pool.calls, pool.errors) == (4, 0)

    with RewardPool(cfg) as pool:
        asyncio.run(body(pool))


def test_measure_task_reports_the_step_credit_groups_need():
    from tests.support.tools import load_tool

    step_credit = load_tool("measure_task").step_credit
    # v = [1, 0 | 1, 1]: mean 3/4; group stds 0.5 and 0 -> mean 0.25; one group of two mixed
    texts = [RIGHT, "", RIGHT, RIGHT]
    assert step_credit(texts, [ITEM] * 4, 2) == (0.75, 0.25, 0.5)
    mean, std, mixed = step_credit(texts, [ITEM] * 4, 1)
    assert mean == 0.75 and math.isnan(std) and math.isnan(mixed)
