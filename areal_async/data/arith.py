"""Generated small-number arithmetic: the CPU quickstart task (why: docs/quickstart_task.md).

    add   "What is a + b?"       0 <= a, b < 30          (900 problems)
    sub   "What is a - b?"       0 <= b <= a < 40        (820 problems)
    sum3  "What is a + b + c?"   0 <= a, b, c < 10       (1000 problems)

Every problem once, shuffled by ``seed`` (a pure function of it); per kind the first
``TEST_PER_KIND`` are the test split, the next ``DEMOS_PER_KIND`` the few-shot pool, the rest
training (disjoint), interleaved kind by kind so any test prefix covers every kind. Answers are
integers; demonstrations end in ``\\boxed{N}``; scored by ``"math"``. Generated items are
``TaskItem``s of a ``ChatTask``, as the ``file`` task's rows are.
"""

from __future__ import annotations

import itertools

import msgspec

from areal_async.config import DataConfig
from areal_async.data.task import ChatTask, TaskItem, pick_generated, split_generated

SYSTEM = "You are a helpful assistant. Put the final answer in \\boxed{}."
INSTRUCTION = "Put the final answer in \\boxed{}."
DATASET_SEED = 0  # the dataset is fixed; the run seed only orders it (data.prompts)
TEST_PER_KIND = 100
DEMOS_PER_KIND = 4
KINDS = ("add", "sub", "sum3")


class ArithItem(msgspec.Struct, frozen=True):
    """One problem: the operands (left to right) and the operator; ``-`` has two operands."""

    kind: str
    operands: tuple[int, ...]

    @property
    def op(self) -> str:
        return "-" if self.kind == "sub" else "+"

    @property
    def answer(self) -> int:
        first, *rest = self.operands
        return first - sum(rest) if self.kind == "sub" else first + sum(rest)

    @property
    def expression(self) -> str:
        return f" {self.op} ".join(map(str, self.operands))

    def question(self) -> str:
        return f"What is {self.expression}?"

    def demo_answer(self) -> str:
        return f"{self.expression} = {self.answer}. The answer is \\boxed{{{self.answer}}}."


def _enumerate(kind: str) -> list[ArithItem]:
    if kind == "add":
        pairs = itertools.product(range(30), repeat=2)
    elif kind == "sub":
        pairs = ((a, b) for a in range(40) for b in range(a + 1))
    elif kind == "sum3":
        pairs = itertools.product(range(10), repeat=3)
    else:
        raise ValueError(f"unknown arithmetic kind '{kind}'; choose one of {KINDS}")
    return [ArithItem(kind, tuple(p)) for p in pairs]


def generate_splits(seed: int = DATASET_SEED) -> dict[str, list[ArithItem]]:
    """The ``train``, ``test`` and ``demos`` lists: disjoint, a pure function of ``seed``."""
    return split_generated([_enumerate(kind) for kind in KINDS], seed, TEST_PER_KIND, DEMOS_PER_KIND)


class ArithTask(ChatTask):
    """Arithmetic items with ``few_shot`` demonstrations; scored by ``"math"``. Each item's row is
    what a ``file`` task row would hold: ``prompt``, ``answer`` (an int), ``kind``, ``operands``."""

    def __init__(self, items: list[ArithItem], demos: list[ArithItem] = ()):
        super().__init__("arith", [_task_item(x) for x in items], reward_fn="math",
                         demos=[(d.question(), d.demo_answer()) for d in demos], system=SYSTEM,
                         instruction=INSTRUCTION)


def _task_item(x: ArithItem) -> TaskItem:
    row = {"prompt": x.question(), "answer": x.answer, "kind": x.kind, "operands": list(x.operands)}
    return TaskItem(prompt=[{"role": "user", "content": row["prompt"]}], answer=str(x.answer),
                    row=row, source=f"arith {x.kind} {x.expression}")


def load_arith(cfg: DataConfig, split: str) -> ArithTask:
    """The ``split`` ("train" | "test") of the arithmetic task with ``cfg.few_shot`` demos.

    ``cfg.train_path`` / ``cfg.test_path`` are not read: the data is generated.

    Raises:
        ValueError: unknown split, or ``few_shot`` outside ``0..len(KINDS) * DEMOS_PER_KIND``.
    """
    return ArithTask(*pick_generated("arith", generate_splits(DATASET_SEED), split, cfg.few_shot))
