"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay to a floor.

The schedule advances once per **training step** (one batch from the queue), not once per
optimizer update: with ``algo.ppo_minibatches`` = n > 1 the n updates of step ``k`` all use the
same learning rate ``lr · lr_factor(k, ...)``. This is verl's convention (its actor steps the
scheduler once per ``update_policy`` call, after all mini-batches), and it keeps
``trainer.total_steps`` and ``trainer.warmup_steps`` in the unit the user counts in.

Factor of step ``k`` (0-based) with W = ``warmup_steps``, T = ``total_steps``, r = ``min_lr_ratio``:

- warm-up, ``k < W``: ``(k + 1) / W`` (so step 0 already learns, at ``lr / W``; step ``W - 1``
  is at the full ``lr``);
- after it, ``p = (k - W) / (T - W)`` in ``[0, 1)``:
  ``constant``: 1; ``linear``: ``r + (1 - r)(1 - p)``; ``cosine``: ``r + (1 - r)(1 + cos πp) / 2``
  (the floor ``r`` is approached, and reached one step after the last).

The scheduler is a ``torch.optim.lr_scheduler.LambdaLR``; its state (``last_epoch``) is saved in
the checkpoint and restored by a resume (``resume.py``), so a resumed run's ``train/lr`` is the
unbroken run's.
"""

from __future__ import annotations

import functools
import math

import torch

from areal_async.config import TrainerConfig

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of ``trainer.lr`` during training step ``step`` (see the module doc).

    A step at or past ``total_steps`` gets the floor ``min_lr_ratio`` (``constant``: 1).

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
