"""The ``Task`` seam: a fixed, indexable list of chat questions with gold answers and a reward name
(``reward.pool.REWARD_FNS``); tokenising and the group-id map are ``data.prompts.PromptSet``'s."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Protocol

from areal_async.config import DataConfig

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


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

    def messages(self, i: int) -> list[dict[str, str]]:
        """Chat turns for item ``i`` (``{"role", "content"}`` dicts) ending with the user's
        question; few-shot demonstrations, if any, come first as earlier turns."""

    def gold(self, i: int) -> str:
        """Gold answer of item ``i`` as the reward function expects it (e.g. ``"72"``)."""


TaskLoader = Callable[[DataConfig, str], Task]
"""``loader(cfg, split) -> Task`` with ``split`` in ``{"train", "test"}``."""


def build_messages(question: str, demos: Sequence[tuple[str, str]] = (),
                   system: str | None = None,
                   instruction: str = BOXED_INSTRUCTION) -> list[dict[str, str]]:
    """Chat turns: optional system turn, ``demos`` as (question, answer) user/assistant pairs,
    then ``question``. The ``\\boxed{}`` instruction follows every question."""
    turns = [{"role": "system", "content": system}] if system else []
    for q, a in demos:
        turns += [{"role": "user", "content": f"{q}\n{instruction}"},
                  {"role": "assistant", "content": a}]
    turns.append({"role": "user", "content": f"{question}\n{instruction}"})
    return turns


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
                            f"data.train_path / data.test_path to an existing JSONL file")
