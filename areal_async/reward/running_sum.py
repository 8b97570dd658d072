"""Step credit for the running-sum task (``data/longchain.py``): ``longchain_steps``, registered
in ``REWARD_FNS``; meant for ``reward.graded`` (why: docs/staleness_study.md, "Long responses").

The gold answer of numbers ``x_0 .. x_n`` is ``n`` step lines ``t + x = t'`` (``t`` the running
total before ``x``; ``chain_steps``) and then ``\\boxed{total}``. The value is

    v = (k + b) / (n + 1)

with ``k`` the number of leading non-blank response lines equal to the gold step lines in order
(all whitespace ignored; the first line that differs stops the count, so a line of prose before
the steps gives k = 0), and ``b = 1`` when ``k = n`` and the last ``\\boxed{}`` holds the total
(whitespace ignored, digits only: ``\\boxed{1,000}`` does not count), else 0. A fully right
answer scores exactly 1.0, so under ``reward.graded`` it is the one counted correct. Lines after
the ``n`` steps are not read. Imports no torch: the reward processes load it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from areal_async.reward.math import extract_boxed


def chain_steps(numbers: Sequence[int]) -> list[str]:
    """The gold step lines of ``numbers``: ``"t + x = t'"``, one per number after the first."""
    totals = list(itertools.accumulate(numbers))
    return [f"{t} + {x} = {t + x}" for t, x in zip(totals, numbers[1:])]


def _squeeze(text: str) -> str:
    return "".join(text.split())


def longchain_steps(response: str, item: dict[str, Any]) -> float:
    """Prefix credit in [0, 1] of ``response`` for ``item["numbers"]`` (formula: module docstring).

    Raises:
        ValueError: ``item`` has no ``numbers`` list of ints (names what it has and the task
            that provides it).
    """
    numbers = item.get("numbers")
    if not isinstance(numbers, list) or not all(isinstance(x, int) for x in numbers):
        raise ValueError(f"longchain_steps needs item['numbers'], a list of ints, got "
                         f"{numbers!r} (item fields: {sorted(item)}); use it with data.task: "
                         f"longchain, whose rows carry the numbers")
    steps = chain_steps(numbers)
    lines = [_squeeze(line) for line in response.splitlines()]
    lines = [line for line in lines if line]
    k = 0
    for got, want in zip(lines, steps):
        if got != _squeeze(want):
            break
        k += 1
    boxed = extract_boxed(response)
    b = int(k == len(steps) and boxed is not None and _squeeze(boxed) == str(sum(numbers)))
    return (k + b) / (len(steps) + 1)
