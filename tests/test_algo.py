"""GRPO advantages and the decoupled-PPO loss against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.algo.advantages import batch_normalize, group_advantages
from areal_async.algo.loss import decoupled_ppo_loss


def test_group_advantages_hand_values():
    # Group 0 = [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], population var (4+1+0+9)/4 = 3.5,
    # so A = centred / (sqrt(3.5) + 1e-6). Group 1 = [5, 5, 5, 5]: all equal ⇒ exactly 0.
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, group_size=4)
    std = math.sqrt(3.5) + 1e-6
    expected = torch.tensor([-2 / std, -1 / std, 0.0, 3 / std, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_group_advantages_without_std_and_all_equal_inexact_floats():
    # std_norm=False only centres: [5, -5] → [5, -5]; [0.1]*3 groups must be exactly 0 even though
    # mean(0.1, 0.1, 0.1) is not exactly 0.1 in floating point.
    adv = group_advantages(torch.tensor([5.0, -5.0]), group_size=2, std_norm=False)
    assert adv.tolist() == [5.0, -5.0]
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, -5.0, -5.0, -5.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))
    assert not torch.isnan(adv).any()


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="divide"):
        group_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)


def test_batch_normalize():
    # Valid entries [1, 3] (the third is masked): mean 2, std 1 → [-1/(1+eps), 1/(1+eps), 0].
    out = batch_normalize(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
    torch.testing.assert_close(out, torch.tensor([-1 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0]))
    assert torch.equal(batch_normalize(torch.full((3,), 0.3)), torch.zeros(3))


def _tokens():
    # Four tokens, ε = 0.2. Log-probs chosen so r and w are round numbers:
    #   t0: r = 1.5, w = 1, A = +1: min(1.5·1, clip(1.5)=1.2·1) = 1.2  (clipped, upper side)
    #   t1: r = 0.5, w = 1, A = -1: min(-0.5, clip(0.5)=0.8·-1 = -0.8) = -0.8  (clipped, lower side)
    #   t2: r = 1.1, w = exp(0 - log 0.5) = 2, A = +2: min(2.2, 2.2) = 2.2, times w = 4.4
    #   t3: masked out; theta = -inf must not leak a NaN.
    # L = -(1.2 - 0.8 + 4.4) / 3 = -1.6; clip_ratio = 2/3; importance_weight = (1+1+2)/3.
    theta = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), -math.inf], requires_grad=True)
    prox = torch.tensor([0.0, 0.0, 0.0, 0.0])
    behav = torch.tensor([0.0, 0.0, math.log(0.5), 0.0])
    adv = torch.tensor([1.0, -1.0, 2.0, 7.0])
    mask = torch.tensor([True, True, True, False])
    return theta, prox, behav, adv, mask


def test_decoupled_ppo_loss_hand_values_and_gradient():
    theta, prox, behav, adv, mask = _tokens()
    loss, stats = decoupled_ppo_loss(theta, prox, behav, adv, mask, eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(-1.6))
    torch.testing.assert_close(stats["clip_ratio"], torch.tensor(2 / 3))
    torch.testing.assert_close(stats["importance_weight"], torch.tensor(4 / 3))
    assert stats["num_tokens"].item() == 3
    loss.backward()
    # Clipped tokens have zero gradient; t2: d/dθ(-w·r·A/3) = -w·A·r/3 = -2·2·1.1/3.
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, 0.0, -4.4 / 3, 0.0]))


def test_decoupled_ppo_loss_clip_high_and_cap():
    theta, prox, behav, adv, mask = _tokens()
    # ε_high = 0.6: t0 is no longer clipped (1.5 < 1.6): L = -(1.5 - 0.8 + 4.4)/3 = -1.7.
    loss, stats = decoupled_ppo_loss(theta, prox, behav, adv, mask, 0.2, eps_clip_high=0.6)
    torch.testing.assert_close(loss, torch.tensor(-1.7))
    torch.testing.assert_close(stats["clip_ratio"], torch.tensor(1 / 3))
    # Cap c = 1.5: t2 has w = 2 > c ⇒ weight 0 but still counted: L = -(1.2 - 0.8)/3.
    loss, stats = decoupled_ppo_loss(theta, prox, behav, adv, mask, 0.2, behav_imp_weight_cap=1.5)
    torch.testing.assert_close(loss, torch.tensor(-0.4 / 3))
    torch.testing.assert_close(stats["behav_capped_ratio"], torch.tensor(1 / 3))
    torch.testing.assert_close(stats["importance_weight"], torch.tensor(2 / 3))


def test_decoupled_ppo_loss_empty_mask_is_zero():
    theta = torch.tensor([-math.inf, 0.3], requires_grad=True)
    zeros = torch.zeros(2)
    loss, stats = decoupled_ppo_loss(theta, zeros, zeros, torch.ones(2), torch.zeros(2, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(theta.grad, torch.zeros(2))
    assert all(not torch.isnan(v).any() for v in stats.values())
    loss, _ = decoupled_ppo_loss(*(torch.zeros(0) for _ in range(4)), torch.zeros(0, dtype=torch.bool))
    assert loss.item() == 0.0


def test_decoupled_ppo_loss_global_denominator_adds_up():
    # Splitting the tokens into two calls with num_tokens = 3 gives shares that sum to the mean.
    theta, prox, behav, adv, mask = _tokens()
    full, _ = decoupled_ppo_loss(theta, prox, behav, adv, mask)
    parts = [decoupled_ppo_loss(theta[s], prox[s], behav[s], adv[s], mask[s], num_tokens=3)
             for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full)
    torch.testing.assert_close(parts[0][1]["clip_ratio"] + parts[1][1]["clip_ratio"], torch.tensor(2 / 3))
    half, _ = decoupled_ppo_loss(theta, prox, behav, adv, mask, num_tokens=6)
    torch.testing.assert_close(half, torch.tensor(-0.8))


def test_decoupled_ppo_loss_shape_mismatch():
    with pytest.raises(AssertionError, match="prox_logp"):
        decoupled_ppo_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.zeros(3), torch.ones(3))
