"""The off-policy corrections of ``algo/corrections.py`` and the objective registry, against
hand-derived values (the peers' own code: tests/test_loss_parity.py).

With θ = π_prox (r_t = 1, nothing clipped) each loss is -Σ_t w_t A_t / Σ_t m_t and its gradient
w.r.t. θ_t is -w_t A_t / Σ_t m_t: the cases below only need each objective's w_t.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from areal_async.algo.corrections import gspo_loss, icepop_loss, m2po_kept, m2po_loss, mis_loss, tis_loss
from areal_async.algo.objectives import OBJECTIVES
from areal_async.config import AlgoConfig
from areal_async.trainer.step import STAT_KEYS


def _on_policy(log_w: list[float], adv: list[float], mask: list[bool] | None = None):
    """θ = π_prox = 0 with grad, π_behav = -log w, advantages, mask (all true by default)."""
    n = len(log_w)
    theta = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    behav = -torch.tensor(log_w, dtype=torch.float64)
    mask_t = torch.tensor(mask if mask is not None else [True] * n)
    return theta, theta.detach().clone(), behav, torch.tensor(adv, dtype=torch.float64), mask_t


def _check(loss, theta, value: float, grad: list[float]):
    torch.testing.assert_close(loss, torch.tensor(value, dtype=torch.float64))
    g, = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64))


def test_tis_truncates_the_weight_at_the_cap():
    # w = [min(4, 2), 0.5, 1] = [2, 0.5, 1], A = [1, -1, 2]: loss = -(2 - 0.5 + 2)/3 = -3.5/3,
    # gradient -w·A/3 = [-2/3, 0.5/3, -2/3]; one token of three above the cap.
    theta, prox, behav, adv, mask = _on_policy([math.log(4), math.log(0.5), 0.0], [1.0, -1.0, 2.0])
    loss, stats = tis_loss(theta, prox, behav, adv, mask, imp_weight_cap=2.0)
    _check(loss, theta, -3.5 / 3, [-2 / 3, 0.5 / 3, -2 / 3])
    assert stats["tis_truncated_ratio"].item() == pytest.approx(1 / 3)
    assert stats["importance_weight"].item() == pytest.approx(3.5 / 3)


def test_mis_weights_a_sequence_by_its_ratio_or_masks_it():
    # Sequence 0 = positions 0-2, position 1 off the loss mask (its log w = log 100 is not counted):
    # ρ0 = 1.5 · 1.2 = 1.8 ∈ [0.5, 2], kept with w = 1.8. Sequence 1 = positions 3-4: ρ1 = 2 · 1.5 = 3
    # > 2, masked. A = 1 on sequence 0, -1 on 1; 4 loss tokens: loss = -(1.8 + 1.8)/4 = -0.9,
    # gradient [-1.8/4, 0, -1.8/4, 0, 0]; 2 of the 4 loss tokens masked.
    log_w = [math.log(1.5), math.log(100), math.log(1.2), math.log(2), math.log(1.5)]
    theta, prox, behav, adv, mask = _on_policy(log_w, [1.0, 1.0, 1.0, -1.0, -1.0], [True, False, True, True, True])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    loss, stats = mis_loss(theta, prox, behav, adv, mask, cu, seq_ratio_low=0.5, seq_ratio_high=2.0)
    _check(loss, theta, -0.9, [-0.45, 0.0, -0.45, 0.0, 0.0])
    assert stats["mis_masked_ratio"].item() == pytest.approx(0.5)


def test_icepop_masks_tokens_outside_the_bounds_inclusive():
    # k = [0.4, 0.5, 5, 6] with [α, β] = [0.5, 5]: w = [0, 0.5, 5, 0] (the bounds are kept), A = 1:
    # loss = -(0.5 + 5)/4 = -1.375, gradient [0, -0.125, -1.25, 0]; half the tokens masked.
    theta, prox, behav, adv, mask = _on_policy([math.log(0.4), math.log(0.5), math.log(5), math.log(6)], [1.0] * 4)
    loss, stats = icepop_loss(theta, prox, behav, adv, mask, ratio_low=0.5, ratio_high=5.0)
    _check(loss, theta, -1.375, [0.0, -0.125, -1.25, 0.0])
    assert stats["icepop_masked_ratio"].item() == pytest.approx(0.5)


def test_m2po_drops_the_largest_second_moments_until_the_rest_is_below_tau():
    # (log w)² = [0.25, 0.09, 0.01, 0], τ = 0.04. Largest first, the mean of the rest: all four
    # 0.35/4 = 0.0875 ≥ τ; without 0.25: 0.10/3 = 0.0333 < τ, so one token is dropped. A = [1, 2, 3, 4]:
    # loss = -(2 + 3 + 4)/4 = -2.25, gradient [0, -0.5, -0.75, -1]; M2 before the mask 0.0875.
    theta, prox, behav, adv, mask = _on_policy([0.5, -0.3, 0.1, 0.0], [1.0, 2.0, 3.0, 4.0])
    loss, stats = m2po_loss(theta, prox, behav, adv, mask, m2_threshold=0.04)
    _check(loss, theta, -2.25, [0.0, -0.5, -0.75, -1.0])
    assert stats["m2po_masked_ratio"].item() == pytest.approx(0.25)
    assert stats["m2po_m2"].item() == pytest.approx(0.0875)
    # τ below every token's (log w)²: all but the smallest are dropped (one is always kept), and
    # positions off the mask are never kept
    log_w = torch.tensor([0.5, 0.3, 9.0, 0.4], dtype=torch.float64)
    assert m2po_kept(log_w, torch.tensor([True, True, False, True]), 1e-9).tolist() == [False, True, False, False]
    assert m2po_kept(log_w, torch.zeros(4, dtype=torch.bool), 0.04).tolist() == [False] * 4


def test_gspo_clips_the_geometric_mean_ratio_of_a_sequence():
    # One sequence, θ - π_prox = [0.2, -0.1]: s = exp(0.05) = 1.05127; π_behav = π_prox (w = 1), A = 1.
    # ε = 0.2: unclipped, loss = -(s + s)/2 = -s, and GSPO-token's ∂s_t/∂θ_t = s gives -s/2 each.
    # ε = ε_high = 0.01: s > 1.01 with A > 0, clipped: loss = -1.01, no gradient, clip_ratio 1.
    theta = torch.tensor([0.2, -0.1], dtype=torch.float64, requires_grad=True)
    zero, ones, cu = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), torch.tensor([0, 2])
    s = math.exp(0.05)
    loss, stats = gspo_loss(theta, zero, zero, ones, torch.ones(2, dtype=torch.bool), cu.int(), 0.2, 0.2)
    _check(loss, theta, -s, [-s / 2, -s / 2])
    assert stats["ratio"].item() == pytest.approx(s) and stats["clip_ratio"].item() == 0.0
    loss, stats = gspo_loss(theta, zero, zero, ones, torch.ones(2, dtype=torch.bool), cu.int(), 0.01, 0.01)
    _check(loss, theta, -1.01, [0.0, 0.0])
    assert stats["clip_ratio"].item() == 1.0


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_returns_the_step_statistics_and_its_own(name):
    # What trainer/step.py sums: STAT_KEYS and the objective's stat_keys, finite, for a batch of two
    # sequences with made-up log-probs; an empty loss mask gives a loss of exactly 0.
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    batch = types.SimpleNamespace(behav_logprobs=theta.detach() + 0.3 * torch.randn(7, generator=g, dtype=torch.float64),
                                  advantages=torch.randn(7, generator=g, dtype=torch.float64),
                                  loss_mask=torch.tensor([False, True, True, False, True, True, True]),
                                  cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    objective = OBJECTIVES[name]
    loss, stats = objective.loss(theta, theta.detach(), batch, AlgoConfig(objective=name), 5)
    assert set(STAT_KEYS + objective.stat_keys) <= set(stats)
    assert all(torch.isfinite(stats[k]) for k in STAT_KEYS + objective.stat_keys)
    loss.backward()
    assert torch.isfinite(theta.grad).all()
    batch.loss_mask = torch.zeros(7, dtype=torch.bool)
    loss, _ = objective.loss(theta, theta.detach(), batch, AlgoConfig(objective=name), 0)
    assert loss.item() == 0.0
