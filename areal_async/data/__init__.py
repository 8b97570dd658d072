"""Prompt sources: ``TASKS`` maps ``data.task`` names to loaders ``loader(cfg, split) -> Task``:
``file`` (your JSONL or Parquet rows), ``gsm8k``, ``arith``, ``calc`` (with the calculator tool),
``longchain`` (running sums with answers of hundreds of tokens); all are ``ChatTask``s."""

from areal_async.data.arith import load_arith
from areal_async.data.calc import load_calc
from areal_async.data.file import load_file
from areal_async.data.gsm8k import load_gsm8k
from areal_async.data.longchain import load_longchain
from areal_async.data.prompts import PromptItem, PromptSet
from areal_async.data.task import ChatTask, Task, TaskItem, TaskLoader, build_messages

TASKS: dict[str, TaskLoader] = {
    "file": load_file,
    "gsm8k": load_gsm8k,
    "arith": load_arith,
    "calc": load_calc,
    "longchain": load_longchain,
}


def load_task(cfg, split: str) -> Task:
    """``TASKS[cfg.task](cfg, split)``; raises ``ValueError`` naming the registered tasks."""
    if cfg.task not in TASKS:
        raise ValueError(f"data.task '{cfg.task}' is not a registered task; choose one of "
                         f"{sorted(TASKS)}")
    return TASKS[cfg.task](cfg, split)


__all__ = ["TASKS", "ChatTask", "PromptItem", "PromptSet", "Task", "TaskItem", "TaskLoader",
           "build_messages", "load_task"]
