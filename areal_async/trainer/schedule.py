"""The learning-rate schedule (warm-up, then constant, linear or cosine decay to a floor; ``lr_factor``).

Invariant: it advances once per training step, not per optimizer update (verl's convention), and
its state is checkpointed, so a resumed run's ``train/lr`` is the unbroken run's.
"""

from __future__ import annotations

import functools
import math

import torch

from areal_async.config import TrainerConfig

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of ``trainer.lr`` during training step ``step`` (0-based).

    With W = ``warmup_steps``, T = ``total_steps``, r = ``min_lr_ratio``: warm-up, ``step < W``:
    ``(step + 1) / W`` (step 0 already learns, at ``lr / W``; step ``W - 1`` at the full ``lr``);
    after it, ``p = (step - W) / (T - W)`` in ``[0, 1)``: ``constant`` 1, ``linear``
    ``r + (1 - r)(1 - p)``, ``cosine`` ``r + (1 - r)(1 + cos πp) / 2``. A step at or past ``total_steps``
    gets the floor ``r`` (``constant``: 1).

    Raises:
        ValueError: ``schedule`` is not one of ``SCHEDULES``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"trainer.lr_schedule={schedule!r} is not a schedule; choose one of {list(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``LambdaLR`` of ``cfg``'s schedule over ``optimizer`` (whose ``lr`` is ``cfg.lr``).

    Construction sets the learning rate of step 0; call ``step()`` once after each training step.
    """
    fn = functools.partial(lr_factor, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                           total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
