"""GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems") as a ``ChatTask``.

Read with the ``file`` task's reader (``data.file.read_items``: same files, same errors naming
file and line) and its own row rule: fields ``question`` (stripped, one user turn) and ``answer``;
gold = the number after the answer's ``####``, thousands commas removed. Every question ends with
``BOXED_INSTRUCTION``. The ``data.few_shot`` demonstrations are the first training items,
rewritten to end in ``\\boxed{}`` (``<<48/2=24>>`` annotations dropped) and left out of the
training split.
"""

from __future__ import annotations

import pathlib
import re

from areal_async.config import DataConfig
from areal_async.data.file import read_items
from areal_async.data.task import BOXED_INSTRUCTION, ChatTask, TaskItem, resolve_data_path

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CALC = re.compile(r"<<[^>]*>>")


class GSM8KItem(TaskItem, frozen=True):
    """A GSM8K ``TaskItem``, with the dataset's own names for its parts."""

    @property
    def question(self) -> str:
        return self.prompt[-1]["content"]

    @property
    def solution(self) -> str:
        return self.row["answer"]

    @property
    def gold(self) -> str:
        return self.answer


def read_gsm8k(path: str | pathlib.Path) -> list[GSM8KItem]:
    """Parse a GSM8K JSONL file; blank lines are skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed line: names the file and 1-based line number, and what is wrong
            (not JSON, missing/non-string field, no ``####``, not a number after ``####``).
    """
    return read_items(path, _parse_row, what="GSM8K line")


def _parse_row(row: dict, source: str) -> GSM8KItem:
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"field '{key}' is missing or not a non-empty string (for rows of "
                             f"your own, set data.task=file)")
    if "####" not in row["answer"]:
        raise ValueError("the answer has no '#### <number>' final line")
    gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(gold):
        raise ValueError(f"'{gold}' after '####' is not a number")
    return GSM8KItem(prompt=[{"role": "user", "content": row["question"].strip()}], answer=gold,
                     row=row, source=source)


def demo_answer(item: GSM8KItem) -> str:
    """The item's solution as a demonstration: no calculator annotations, ``\\boxed{}`` last."""
    steps = _CALC.sub("", item.solution.rsplit("####", 1)[0]).strip()
    return f"{steps}\nThe final answer is \\boxed{{{item.gold}}}."


class GSM8KTask(ChatTask):
    """GSM8K items with optional few-shot demonstrations; scored by ``"math"``."""

    def __init__(self, items: list[GSM8KItem], demos: list[GSM8KItem] = ()):
        super().__init__("gsm8k", items, reward_fn="math",
                         demos=[(d.question, demo_answer(d)) for d in demos],
                         instruction=BOXED_INSTRUCTION)


def load_gsm8k(cfg: DataConfig, split: str) -> GSM8KTask:
    """The ``split`` ("train" | "test") of GSM8K from ``cfg.train_path`` / ``cfg.test_path``.

    Raises:
        ValueError: unknown split, negative ``few_shot``, or a malformed line (file:line).
        FileNotFoundError: a data file is missing.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split '{split}' is not 'train' or 'test'")
    if cfg.few_shot < 0:
        raise ValueError(f"data.few_shot must be >= 0, got {cfg.few_shot}")
    need_train = split == "train" or cfg.few_shot > 0
    train = read_gsm8k(resolve_data_path(cfg.train_path)) if need_train else []
    demos = train[: cfg.few_shot]
    items = train[cfg.few_shot :] if split == "train" else read_gsm8k(
        resolve_data_path(cfg.test_path))
    return GSM8KTask(items, demos)
