"""Generated two-number arithmetic to solve with the calculator tool: the agent quickstart's task
(why these numbers: docs/agent_task.md).

    add  "What is a + b?"   10 <= a, b < 100      (8100 problems)
    sub  "What is a - b?"   10 <= b <= a < 100    (4095 problems)
    mul  "What is a * b?"   2 <= a < 10 <= b < 100 (720 problems)

Every problem once, shuffled by a fixed seed; per kind the first ``TEST_PER_KIND`` are the test
split, the next ``DEMOS_PER_KIND`` the demonstration pool, the rest training (disjoint),
interleaved kind by kind. A demonstration is a whole tool episode as earlier chat turns: the
question, a ``<calculator>`` call, its ``tool`` result, the answer in ``\\boxed{}``. The system
turn is ``ToolSet(["calculator"]).system_prompt()`` and the boxed-answer instruction. Scored by
``"math"``; run with ``rollout.tools: [calculator]`` (``configs/agent_cpu.yaml``).
"""

from __future__ import annotations

import itertools

from areal_async.config import DataConfig
from areal_async.data.task import ChatTask, TaskItem, pick_generated, split_generated
from areal_async.tools import ToolSet

DATASET_SEED = 0
TEST_PER_KIND = 100
DEMOS_PER_KIND = 4
KINDS = ("add", "sub", "mul")
OPS = {"add": "+", "sub": "-", "mul": "*"}
INSTRUCTION = "Put the final answer in \\boxed{}."


def _problems(kind: str) -> list[tuple[str, int, int]]:
    if kind == "add":
        pairs = itertools.product(range(10, 100), repeat=2)
    elif kind == "sub":
        pairs = ((a, b) for a in range(10, 100) for b in range(10, a + 1))
    elif kind == "mul":
        pairs = itertools.product(range(2, 10), range(10, 100))
    else:
        raise ValueError(f"unknown calc kind '{kind}'; choose one of {KINDS}")
    return [(kind, a, b) for a, b in pairs]


def _answer(kind: str, a: int, b: int) -> int:
    return a + b if kind == "add" else a - b if kind == "sub" else a * b


def generate_splits(seed: int = DATASET_SEED) -> dict[str, list[tuple[str, int, int]]]:
    """The ``train``, ``test`` and ``demos`` lists of ``(kind, a, b)``: disjoint, a pure function
    of ``seed``."""
    return split_generated([_problems(kind) for kind in KINDS], seed, TEST_PER_KIND, DEMOS_PER_KIND)


def _question(kind: str, a: int, b: int) -> str:
    return f"What is {a} {OPS[kind]} {b}?"


def demo_turns(kind: str, a: int, b: int) -> list[dict[str, str]]:
    """One demonstration: question, call, result, answer, as chat turns."""
    answer = _answer(kind, a, b)
    return [{"role": "user", "content": f"{_question(kind, a, b)}\n{INSTRUCTION}"},
            {"role": "assistant", "content": f"<calculator>{a} {OPS[kind]} {b}</calculator>"},
            {"role": "tool", "content": f"<result>\n{answer}\n</result>"},
            {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."}]


class CalcTask(ChatTask):
    """The calculator task's items, each after the system turn and ``demos`` demonstrations."""

    def __init__(self, items: list[tuple[str, int, int]], demos: list[tuple[str, int, int]] = ()):
        task_items = [TaskItem(prompt=[{"role": "user", "content": _question(*x)}], answer=str(_answer(*x)),
                               row={"prompt": _question(*x), "answer": _answer(*x), "kind": x[0],
                                    "operands": [x[1], x[2]]},
                               source=f"calc {x[0]} {x[1]} {OPS[x[0]]} {x[2]}") for x in items]
        system = f"{ToolSet(['calculator']).system_prompt()}\n{INSTRUCTION}"
        super().__init__("calc", task_items, reward_fn="math", system=system, instruction=INSTRUCTION)
        self._preamble += [turn for d in demos for turn in demo_turns(*d)]


def load_calc(cfg: DataConfig, split: str) -> CalcTask:
    """The ``split`` ("train" | "test") of the calculator task with ``cfg.few_shot`` demos.

    Raises:
        ValueError: unknown split, or ``few_shot`` outside ``0..len(KINDS) * DEMOS_PER_KIND``.
    """
    return CalcTask(*pick_generated("calc", generate_splits(DATASET_SEED), split, cfg.few_shot))
