"""The learning-rate schedule (trainer/schedule.py): hand-derived factors, and a resume that
continues it exactly."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.config import load_config
from areal_async.trainer.resume import load_training_state, save_training_state
from areal_async.trainer.schedule import lr_factor, make_scheduler


def _trainer(*overrides: str):
    return load_config(None, ["trainer.lr=0.1", *overrides]).trainer


def test_constant_with_warm_up():
    # W = 4: steps 0..3 at (k+1)/4 = 0.25, 0.5, 0.75, 1; then 1 to the end
    got = [lr_factor(k, "constant", 4, 10, 0.0) for k in range(10)]
    assert got == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6
    assert [lr_factor(k, "constant", 0, 3, 0.5) for k in range(3)] == [1.0, 1.0, 1.0]


def test_linear_decay_to_the_floor():
    # W = 2, T = 6, r = 0.2: warm-up 0.5, 1; then p = (k-2)/4 = 0, 1/4, 2/4, 3/4 for k = 2..5,
    # factor = 0.2 + 0.8 (1 - p) = 1, 0.8, 0.6, 0.4; one step past the end it is the floor 0.2
    got = [lr_factor(k, "linear", 2, 6, 0.2) for k in range(7)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2], abs=1e-15)


def test_cosine_decay():
    # W = 0, T = 4, r = 0: p = k/4, factor = (1 + cos(πk/4))/2 = 1, (1 + √2/2)/2, 1/2, (1 - √2/2)/2
    half = math.sqrt(2) / 2
    got = [lr_factor(k, "cosine", 0, 4, 0.0) for k in range(4)]
    assert got == pytest.approx([1.0, (1 + half) / 2, 0.5, (1 - half) / 2], abs=1e-15)
    # with r = 0.1 the same curve is squeezed into [0.1, 1]: 0.1 + 0.9 * 0.5 at the midpoint
    assert lr_factor(2, "cosine", 0, 4, 0.1) == pytest.approx(0.55, abs=1e-15)


def test_unknown_schedule_and_too_long_warm_up_are_named():
    with pytest.raises(ValueError, match="lr_schedule='step'.*constant"):
        lr_factor(0, "step", 0, 1, 0.0)
    with pytest.raises(ValueError, match="choose one of"):
        load_config(None, ["trainer.lr_schedule=exponential"])
    with pytest.raises(ValueError, match=r"trainer.warmup_steps=30 is more than trainer.total_steps=20"):
        load_config(None, ["trainer.warmup_steps=30", "trainer.total_steps=20"])
    with pytest.raises(ValueError, match="min_lr_ratio"):
        load_config(None, ["trainer.min_lr_ratio=1.5"])


def _run(opt, sched, steps: range) -> list[float]:
    """The lr each training step of ``steps`` runs at, stepping as the trainer does."""
    lrs = []
    for _ in steps:
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # (no gradients: the update itself is a no-op, the schedule is what is tested)
        sched.step()
    return lrs


def _make(cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return model, opt, make_scheduler(opt, cfg)


def test_the_trainer_scheduler_runs_the_factors_and_a_resume_continues_it(tmp_path):
    cfg = _trainer("trainer.lr_schedule=linear", "trainer.warmup_steps=2", "trainer.total_steps=6",
                   "trainer.min_lr_ratio=0.2")
    _, opt, sched = _make(cfg)
    unbroken = _run(opt, sched, range(6))
    # 0.1 × the factors of test_linear_decay_to_the_floor
    assert unbroken == pytest.approx([0.05, 0.1, 0.1, 0.08, 0.06, 0.04], abs=1e-15)

    model, opt, sched = _make(cfg)
    first = _run(opt, sched, range(3))
    save_training_state(model, opt, sched, tmp_path, 3, [])
    model2, opt2, sched2 = _make(cfg)  # a fresh process: the scheduler starts at step 0 ...
    assert load_training_state(model2, opt2, sched2, tmp_path) == 3  # ... and is put back at step 3
    assert first + _run(opt2, sched2, range(3, 6)) == unbroken


def test_a_checkpoint_without_scheduler_state_resumes_the_schedule_at_its_step(tmp_path):
    cfg = _trainer("trainer.lr_schedule=cosine", "trainer.total_steps=4")
    model, opt, sched = _make(cfg)
    _run(opt, sched, range(2))
    save_training_state(model, opt, sched, tmp_path, 2, [])
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=False)
    del state["scheduler"]  # as written before the schedule was saved
    torch.save(state, tmp_path / "trainer_state.pt")
    model2, opt2, sched2 = _make(cfg)
    load_training_state(model2, opt2, sched2, tmp_path)
    assert _run(opt2, sched2, range(2, 4)) == pytest.approx([0.05, 0.1 * (1 - math.sqrt(2) / 2) / 2], abs=1e-15)
