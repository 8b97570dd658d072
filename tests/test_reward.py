"""Boxed-answer extraction, math equivalence, and the reward process pool."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from areal_async.config import RewardConfig
from areal_async.reward.math import extract_boxed, math_reward
from areal_async.reward.pool import REWARD_FNS, RewardPool, RewardProcessError, RewardResult


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{72}.", "72"),
    ("\\boxed{1} then \\boxed{2}", "2"),                               # the last one
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                         # nested braces
    ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),                               # deeper nesting
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                             # escaped braces are literal
    ("\\boxed{3} and a cut-off \\boxed{4", "3"),                       # truncated last box skipped
    ("The answer is \\boxed 5.", "5."),                                # brace-less form
    ("$\\boxed {18}$", "18"),                                          # space before the brace
    ("\\fbox{7}", "7"),
    ("\\boxed{}", ""),
    ("The answer is 72.", None),                                       # no box
    ("\\boxed", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response,gold,expected", [
    ("\\boxed{72}", "72", 1.0),
    ("\\boxed{72.0}", "72", 1.0),
    ("\\boxed{\\$72}", "72", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1\\,000}", "1000", 1.0),
    ("\\boxed{18 dollars}", "18", 1.0),
    ("\\boxed{\\text{18 apples}}", "18", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{2}{4}", 1.0),
    ("\\boxed{73}", "72", 0.0),
    ("the answer is 72", "72", 0.0),                                   # no box, no credit
    ("\\boxed{}", "72", 0.0),
    ("\\boxed{72} wait, no: \\boxed{71}", "72", 0.0),                  # the last box counts
    ("\\boxed{banana}", "72", 0.0),
])
def test_math_reward(response, gold, expected):
    assert math_reward(response, gold) == expected


# Top-level so the pool's processes can import them by reference.
def hang(response: str, gold: str) -> float:
    time.sleep(600)
    return 1.0


def boom(response: str, gold: str) -> float:
    raise RuntimeError("verifier bug")


def test_pool_scales_and_counts_failures(capsys):
    cfg = RewardConfig(correct=5.0, wrong=-5.0, format_bonus=0.5, timeout_s=1.0, num_procs=1)

    async def body(pool: RewardPool):
        right = await pool.score("math", "\\boxed{72}", "72")
        wrong = await pool.score("math", "\\boxed{7}", "72")
        unboxed = await pool.score("math", "72", "72")
        assert right == RewardResult(reward=5.5, correct=True, error=False, boxed=True)
        assert wrong == RewardResult(reward=-4.5, correct=False, error=False, boxed=True)
        assert unboxed == RewardResult(reward=-5.0, correct=False, error=False, boxed=False)
        t0 = time.monotonic()
        stuck = await pool.score(hang, "\\boxed{72}", "72")
        assert time.monotonic() - t0 < 60, "the timeout did not cut the call"
        assert (stuck.correct, stuck.error, stuck.reward) == (False, True, -4.5)
        failed = await pool.score(boom, "\\boxed{72}", "72")
        assert (failed.correct, failed.error) == (False, True)
        assert (await pool.score(boom, "\\boxed{72}", "72")).error
        # The stuck process was replaced: the pool still scores.
        assert (await pool.score("math", "\\boxed{\\frac{1}{2}}", "0.5")).correct
        assert pool.stats() == {"reward/calls": 7, "reward/errors": 2, "reward/timeouts": 1,
                                "reward/restarts": 0}
        with pytest.raises(ValueError, match="registered"):
            await pool.score("nope", "", "")

    with RewardPool(cfg) as pool:
        asyncio.run(body(pool))
    # The first failure of each kind is printed with its cause; the second raise is not.
    logged = capsys.readouterr().out
    assert logged.count("[reward]") == 2, logged
    assert ("reward function tests.test_reward:boom failed: RuntimeError('verifier bug') at "
            f"{__file__}:63 in boom; scored as an error") in logged
    assert "tests.test_reward:hang took over reward.timeout_s = 1.0 s" in logged


def test_a_pool_starts_its_processes_at_its_first_call():
    # A spawned process imports the modules of its parent's __main__ (a trainer's: torch and the
    # model code); a trainer with no evaluation due never scores, so its pool must start nothing.
    import multiprocessing

    before = set(multiprocessing.active_children())
    with RewardPool(RewardConfig(num_procs=2)) as pool:
        assert set(multiprocessing.active_children()) == before
        assert asyncio.run(pool.score("math", "\\boxed{2}", "2")).correct
        assert len(set(multiprocessing.active_children()) - before) == 2
    assert set(multiprocessing.active_children()) == before


def math_verify_loaded(response: str, gold: str) -> float:
    return float("math_verify" in sys.modules)


def test_a_process_imports_its_functions_module_before_the_first_call():
    # 2 s of imports against a 1 s timeout: counted in the call, it would time out (an error).
    from tests.support.slow_import_reward import full_credit

    with RewardPool(RewardConfig(timeout_s=1.0, num_procs=1)) as pool:
        first = asyncio.run(pool.score(full_credit, "", ""))
        assert (first.correct, first.error) == (True, False), pool.stats()
    # math_verify is imported ahead for the default verifier only
    with RewardPool(RewardConfig(timeout_s=30.0, num_procs=1)) as pool:
        assert asyncio.run(pool.score(math_verify_loaded, "", "")) == RewardResult(-5.0, False, False, False)
    with RewardPool(RewardConfig(timeout_s=30.0, num_procs=1)) as pool:
        assert asyncio.run(pool.score("math", "\\boxed{1}", "1")).correct
        assert asyncio.run(pool.score(math_verify_loaded, "", "")).correct


def test_a_process_whose_imports_hang_is_replaced_by_one_that_imports_only_what_a_call_needs(
        monkeypatch, capsys):
    from areal_async.reward import pool as pool_module
    from tests.support.hanging_import_reward import full_credit

    monkeypatch.setattr(pool_module, "STARTUP_TIMEOUT_S", 2.0)
    with RewardPool(RewardConfig(timeout_s=30.0, num_procs=1)) as pool:
        stuck = asyncio.run(pool.score(full_credit, "", ""))
        assert (stuck.correct, stuck.error) == (False, True)
        # the fresh process does not import that module ahead: the next call is scored
        assert asyncio.run(pool.score("math", "\\boxed{2}", "2")).correct
    assert "failed: reward process not ready within 2.0 s" in capsys.readouterr().out


def exit_on_die(response: str, gold: str) -> float:
    """Ends its process (as a crashing verifier does) on the response "die"; else math."""
    if response == "die":
        os._exit(3)
    return math_reward(response, gold)


def segfault_once(response: str, gold: str) -> float:
    """Kills its process with SIGSEGV the first time (marker file ``gold``), then scores 1."""
    if not os.path.exists(gold):
        open(gold, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return 1.0


def always_exit(response: str, gold: str) -> float:
    sys.exit(7)


def test_pool_replaces_a_dead_process(tmp_path, capsys):
    # One process: before the fix a dead process went back into service and every later call
    # scored as an error (all rewards wrong, all advantages 0).
    cfg = RewardConfig(correct=5.0, wrong=-5.0, timeout_s=30.0, num_procs=1)

    async def body(pool: RewardPool):
        # Dies on the call and on its retry (2 replacements): scored as an error, counted.
        died = await pool.score(exit_on_die, "die", "72")
        assert (died.correct, died.error, died.reward) == (False, True, -5.0)
        # The fresh process scores normally.
        assert await pool.score(exit_on_die, "\\boxed{72}", "72") == RewardResult(
            reward=5.0, correct=True, error=False, boxed=True)
        # A death that the retry does not repeat costs nothing.
        once = await pool.score(segfault_once, "\\boxed{1}", str(tmp_path / "crashed"))
        assert (once.correct, once.error) == (True, False)
        assert pool.stats() == {"reward/calls": 3, "reward/errors": 1, "reward/timeouts": 0,
                                "reward/restarts": 3}

    with RewardPool(cfg) as pool:
        asyncio.run(body(pool))
    logged = capsys.readouterr().out
    assert "tests.test_reward:exit_on_die (exit code 3); replaced (1 so far" in logged
    assert "tests.test_reward:segfault_once (signal SIGSEGV); replaced (3 so far" in logged


def test_pool_stops_on_a_function_that_always_kills_its_process():
    cfg = RewardConfig(timeout_s=30.0, num_procs=1, max_consecutive_deaths=2)

    async def body(pool: RewardPool):
        # Call and retry both die: the second death in a row reaches the bound and raises.
        with pytest.raises(RewardProcessError,
                           match=r"tests\.test_reward:always_exit killed its process 2 times in a "
                                 r"row .*last: exit code 7"):
            await pool.score(always_exit, "\\boxed{1}", "1")
        assert pool.restarts == 2

    with RewardPool(cfg) as pool:
        asyncio.run(body(pool))


def test_registry_has_math():
    assert REWARD_FNS["math"] is math_reward


def test_reward_fn_by_import_path_and_errors():
    from areal_async.reward.pool import resolve_reward_fn

    fn = resolve_reward_fn("tests.support.parity_reward:even_length")
    assert fn("ab", "") == 1.0 and fn("abc", "") == 0.0
    assert resolve_reward_fn("math") is math_reward
    with pytest.raises(ValueError, match="registered: \\['longchain_steps', 'math'\\]"):
        resolve_reward_fn("maths")
    with pytest.raises(ValueError, match="does not import"):
        resolve_reward_fn("tests.support.parity_reward:missing")
