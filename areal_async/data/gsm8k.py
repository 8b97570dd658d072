"""GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems") as a ``Task``.

JSONL lines ``{"question", "answer"}``; gold = the number after the answer's ``####``, thousands
commas removed. The ``data.few_shot`` demonstrations are the first training items, rewritten to end
in ``\\boxed{}`` (``<<48/2=24>>`` annotations dropped) and left out of the training split.
"""

from __future__ import annotations

import json
import pathlib
import re

import msgspec

from areal_async.config import DataConfig
from areal_async.data.task import build_messages, resolve_data_path

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CALC = re.compile(r"<<[^>]*>>")


class GSM8KItem(msgspec.Struct, frozen=True):
    question: str
    solution: str
    gold: str


def read_gsm8k(path: str | pathlib.Path) -> list[GSM8KItem]:
    """Parse a GSM8K JSONL file; blank lines are skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed line: names the file and 1-based line number, and what is wrong
            (not JSON, missing/non-string field, no ``####``, not a number after ``####``).
    """
    path = pathlib.Path(path)
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                items.append(_parse_line(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: malformed GSM8K line: {exc}") from None
    return items


def _parse_line(line: str) -> GSM8KItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object with 'question' and 'answer'")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"field '{key}' is missing or not a non-empty string")
    if "####" not in row["answer"]:
        raise ValueError("the answer has no '#### <number>' final line")
    gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(gold):
        raise ValueError(f"'{gold}' after '####' is not a number")
    return GSM8KItem(question=row["question"].strip(), solution=row["answer"], gold=gold)


def demo_answer(item: GSM8KItem) -> str:
    """The item's solution as a demonstration: no calculator annotations, ``\\boxed{}`` last."""
    steps = _CALC.sub("", item.solution.rsplit("####", 1)[0]).strip()
    return f"{steps}\nThe final answer is \\boxed{{{item.gold}}}."


class GSM8KTask:
    """GSM8K items with optional few-shot demonstrations; scored by ``"math"``."""

    name = "gsm8k"
    reward_fn = "math"

    def __init__(self, items: list[GSM8KItem], demos: list[GSM8KItem] = ()):
        self.items = items
        self._demos = [(d.question, demo_answer(d)) for d in demos]

    def __len__(self) -> int:
        return len(self.items)

    def messages(self, i: int) -> list[dict[str, str]]:
        return build_messages(self.items[i].question, self._demos)

    def gold(self, i: int) -> str:
        return self.items[i].gold


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
