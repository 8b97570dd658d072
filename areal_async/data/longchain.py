"""Generated long running sums: a task whose answers are hundreds of tokens (why:
docs/staleness_study.md, "Long responses").

    "Add these numbers one at a time, writing every running total: 7, 3, 9, ..."

Each problem is a list of ``MIN_LEN..MAX_LEN`` numbers in ``1..MAX_ADDEND``; the answer shows
every partial sum, one line a step (``7 + 3 = 10``, ``10 + 9 = 19``, ...), ~11 tokens a line, and
ends in ``\\boxed{total}``. Three kinds by list length (``short`` 10–19, ``medium`` 20–29,
``long`` 30–40 numbers), ``ITEMS_PER_KIND`` problems each drawn from a fixed seed (duplicates
dropped); split as ``arith`` splits (``task.split_generated``). Scored by ``"math"`` on the final
total only: one wrong step anywhere makes the whole answer wrong, so the pass rate falls with the
list's length. ``reward.fn: longchain_steps`` with ``reward.graded`` gives credit per right step
instead (``reward/running_sum.py``).
"""

from __future__ import annotations

import random

import msgspec

from areal_async.config import DataConfig
from areal_async.data.task import ChatTask, TaskItem, pick_generated, split_generated
from areal_async.reward.running_sum import chain_steps

SYSTEM = "You are a helpful assistant. Put the final answer in \\boxed{}."
INSTRUCTION = "Put the final answer in \\boxed{}."
DATASET_SEED = 0  # the dataset is fixed; the run seed only orders it (data.prompts)
ITEMS_PER_KIND = 3000
TEST_PER_KIND = 40
DEMOS_PER_KIND = 2
MAX_ADDEND = 9
KINDS = {"short": (10, 19), "medium": (20, 29), "long": (30, 40)}  # kind → list lengths, inclusive


class ChainItem(msgspec.Struct, frozen=True):
    """One problem: the numbers to add, left to right."""

    kind: str
    numbers: tuple[int, ...]

    @property
    def answer(self) -> int:
        return sum(self.numbers)

    def question(self) -> str:
        return ("Add these numbers one at a time, writing every running total: "
                f"{', '.join(map(str, self.numbers))}")

    def steps(self) -> list[str]:
        """The answer's lines: ``total + next = new total``, one per number after the first."""
        return chain_steps(self.numbers)

    def demo_answer(self) -> str:
        return "\n".join(self.steps()) + f"\nThe answer is \\boxed{{{self.answer}}}."


def _draw(kind: str, seed: int) -> list[ChainItem]:
    if kind not in KINDS:
        raise ValueError(f"unknown longchain kind '{kind}'; choose one of {tuple(KINDS)}")
    lo, hi = KINDS[kind]
    rng = random.Random(f"longchain {kind} {seed}")
    items = (ChainItem(kind, tuple(rng.randint(1, MAX_ADDEND) for _ in range(rng.randint(lo, hi))))
             for _ in range(ITEMS_PER_KIND))
    return list(dict.fromkeys(items))


def generate_splits(seed: int = DATASET_SEED) -> dict[str, list[ChainItem]]:
    """The ``train``, ``test`` and ``demos`` lists: disjoint, a pure function of ``seed``."""
    return split_generated([_draw(kind, seed) for kind in KINDS], seed, TEST_PER_KIND, DEMOS_PER_KIND)


class LongChainTask(ChatTask):
    """Running-sum items after ``demos`` demonstrations; scored by ``"math"``. Each item's row holds
    ``prompt``, ``answer`` (an int), ``kind`` and ``numbers``."""

    def __init__(self, items: list[ChainItem], demos: list[ChainItem] = ()):
        super().__init__("longchain", [_task_item(x) for x in items], reward_fn="math",
                         demos=[(d.question(), d.demo_answer()) for d in demos], system=SYSTEM,
                         instruction=INSTRUCTION)


def _task_item(x: ChainItem) -> TaskItem:
    row = {"prompt": x.question(), "answer": x.answer, "kind": x.kind, "numbers": list(x.numbers)}
    return TaskItem(prompt=[{"role": "user", "content": row["prompt"]}], answer=str(x.answer),
                    row=row, source=f"longchain {x.kind} of {len(x.numbers)}")


def load_longchain(cfg: DataConfig, split: str) -> LongChainTask:
    """The ``split`` ("train" | "test") of the running-sum task with ``cfg.few_shot`` demos.

    ``cfg.train_path`` / ``cfg.test_path`` are not read: the data is generated.

    Raises:
        ValueError: unknown split, or ``few_shot`` outside ``0..len(KINDS) * DEMOS_PER_KIND``.
    """
    return LongChainTask(*pick_generated("longchain", generate_splits(DATASET_SEED), split, cfg.few_shot))
