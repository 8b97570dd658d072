"""The ``Task`` seam and the one implementation every task shares, ``ChatTask``.

A task is a fixed, indexable list of ``TaskItem``s (the row's own prompt turns, its answer, the
row as read and where it came from) and a reward name (``reward.fn.REWARD_FNS``). ``ChatTask``
renders item i as: optional system turn, few-shot demonstrations as user/assistant pairs, then the
item's turns, an optional instruction appended to its last turn (and to every demonstration's
question). Tokenising and the group-id map are ``data.prompts.PromptSet``'s.
"""

from __future__ import annotations

import itertools
import pathlib
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from areal_async.config import DataConfig

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class TaskItem(msgspec.Struct, frozen=True):
    """One item of a task.

    Fields:
        prompt: the row's own chat turns (``{"role", "content", ...}`` dicts; a prompt string is
            one user turn), before any system turn, demonstration or instruction.
        answer: the gold answer as the reward function receives it (``""``: the rows have none).
        row: the row as read (every field, original names) or as generated; reward functions
            that name ``item`` receive it.
        source: where the row came from, for messages (``train.jsonl:12``, ``x.parquet row 3``).
    """

    prompt: list[dict[str, Any]]
    answer: str
    row: dict[str, Any] = {}
    source: str = ""


class Task(Protocol):
    """A prompt source. Built once per process by a ``TaskLoader``; read-only afterwards.

    Attributes:
        name: the task's registry name.
        reward_fn: key of ``REWARD_FNS`` that scores responses to it (e.g. ``"math"``).
    """

    name: str
    reward_fn: str

    def __len__(self) -> int:
        """Number of items."""

    def messages(self, i: int) -> list[dict[str, Any]]:
        """Chat turns for item ``i`` (``{"role", "content"}`` dicts) ending with the user's
        question; few-shot demonstrations, if any, come first as earlier turns."""

    def gold(self, i: int) -> str:
        """Gold answer of item ``i`` as the reward function expects it (e.g. ``"72"``)."""

    def item(self, i: int) -> TaskItem:
        """Item ``i``: its row and source. ``PromptSet`` treats a task without this method (a
        test double) as having empty rows."""


TaskLoader = Callable[[DataConfig, str], Task]
"""``loader(cfg, split) -> Task`` with ``split`` in ``{"train", "test"}``."""


class ChatTask:
    """A ``Task`` over ``TaskItem``s, rendered as chat.

    Args:
        name: the registry name.
        items: the items, in dataset order.
        reward_fn: the reward name that scores them.
        demos: few-shot (question, answer) pairs shown before every item.
        system: a system turn before everything, or ``None``.
        instruction: text appended (after a newline) to every question: each demonstration's and
            the item's last turn; ``None``: nothing appended.
    """

    def __init__(self, name: str, items: list[TaskItem], reward_fn: str = "math",
                 demos: Sequence[tuple[str, str]] = (), system: str | None = None,
                 instruction: str | None = None):
        self.name = name
        self.reward_fn = reward_fn
        self.items = items
        self._instruction = instruction
        self._preamble = [{"role": "system", "content": system}] if system else []
        for q, a in demos:
            self._preamble += [{"role": "user", "content": self._instructed(q)},
                               {"role": "assistant", "content": a}]

    def __len__(self) -> int:
        return len(self.items)

    def messages(self, i: int) -> list[dict[str, Any]]:
        *turns, last = self.items[i].prompt
        return ([dict(t) for t in self._preamble] + [dict(t) for t in turns]
                + [{**last, "content": self._instructed(last["content"])}])

    def gold(self, i: int) -> str:
        return self.items[i].answer

    def item(self, i: int) -> TaskItem:
        return self.items[i]

    def _instructed(self, question: str) -> str:
        return question if self._instruction is None else f"{question}\n{self._instruction}"


def build_messages(question: str, demos: Sequence[tuple[str, str]] = (),
                   system: str | None = None,
                   instruction: str = BOXED_INSTRUCTION) -> list[dict[str, str]]:
    """Chat turns: optional system turn, ``demos`` as (question, answer) user/assistant pairs,
    then ``question``. The ``\\boxed{}`` instruction follows every question (``ChatTask``'s
    rendering of one item)."""
    item = TaskItem(prompt=[{"role": "user", "content": question}], answer="")
    return ChatTask("", [item], demos=demos, system=system, instruction=instruction).messages(0)


def resolve_data_path(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` as given if it exists (absolute or relative to the working directory), else
    relative to the repository root (where ``data/gsm8k/`` is vendored).

    Raises:
        FileNotFoundError: neither exists; names both places tried.
    """
    p = pathlib.Path(path).expanduser()
    if p.exists():
        return p
    in_repo = REPO_ROOT / p
    if not p.is_absolute() and in_repo.exists():
        return in_repo
    raise FileNotFoundError(f"data file '{path}' not found (also tried {in_repo}); set "
                            f"data.train_path / data.test_path to an existing JSONL or Parquet file")


def split_generated(per_kind: Sequence[list], seed: int, test_per_kind: int, demos_per_kind: int) -> dict[str, list]:
    """A generated task's ``train``, ``test`` and ``demos`` lists: each kind's items (list ``k`` of
    ``per_kind``) shuffled by ``random.Random(seed * len(per_kind) + k)``, its first
    ``test_per_kind`` to the test split, the next ``demos_per_kind`` to the demonstration pool, the
    rest to training; then interleaved kind by kind, so that any prefix covers every kind."""
    parts: dict[str, list[list]] = {"train": [], "test": [], "demos": []}
    for k, items in enumerate(per_kind):
        items = list(items)
        random.Random(seed * len(per_kind) + k).shuffle(items)
        cut = test_per_kind + demos_per_kind
        parts["test"].append(items[:test_per_kind])
        parts["demos"].append(items[test_per_kind:cut])
        parts["train"].append(items[cut:])
    return {name: [x for row in itertools.zip_longest(*lists) for x in row if x is not None]
            for name, lists in parts.items()}


def pick_generated(task: str, splits: dict[str, list], split: str, few_shot: int) -> tuple[list, list]:
    """The items of ``split`` and the first ``few_shot`` demonstrations of a generated task's
    ``splits`` (``split_generated``).

    Raises:
        ValueError: ``split`` not "train" or "test", or ``few_shot`` outside ``0..len(demos)``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split '{split}' is not 'train' or 'test'")
    if not 0 <= few_shot <= len(splits["demos"]):
        raise ValueError(f"data.few_shot must be in 0..{len(splits['demos'])} for task '{task}', got {few_shot}")
    return splits[split], splits["demos"][:few_shot]
