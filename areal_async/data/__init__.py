"""Prompt sources: ``TASKS`` maps ``data.task`` names to loaders ``loader(cfg, split) -> Task``."""

from areal_async.data.arith import load_arith
from areal_async.data.gsm8k import load_gsm8k
from areal_async.data.prompts import PromptItem, PromptSet
from areal_async.data.task import Task, TaskLoader, build_messages

TASKS: dict[str, TaskLoader] = {
    "gsm8k": load_gsm8k,
    "arith": load_arith,
}


def load_task(cfg, split: str) -> Task:
    """``TASKS[cfg.task](cfg, split)``; raises ``ValueError`` naming the registered tasks."""
    if cfg.task not in TASKS:
        raise ValueError(f"data.task '{cfg.task}' is not a registered task; choose one of "
                         f"{sorted(TASKS)}")
    return TASKS[cfg.task](cfg, split)


__all__ = ["TASKS", "PromptItem", "PromptSet", "Task", "TaskLoader", "build_messages", "load_task"]
