"""GRPO advantages, the decoupled-PPO loss and its naive-PPO control against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.algo.advantages import batch_normalize, group_advantages
from areal_async.algo.loss import decoupled_ppo_loss, naive_ppo_loss


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


def _naive_tokens():
    # Five tokens, ε = 0.2, naive PPO: r = π_θ/π_behav, no importance weight.
    #   t0: r = 1.1/1   = 1.1, A = +1: min(1.1, 1.1) = 1.1             (not clipped)
    #   t1: r = 0.9/0.5 = 1.8, A = -1: min(-1.8, -1.2) = -1.8          (not clipped: A < 0, upper side)
    #   t2: r = 0.25/0.5 = 0.5, A = +2: min(1.0, 0.8·2 = 1.6) = 1.0   (not clipped: A > 0, lower side)
    #   t3: r = 0.75/0.5 = 1.5, A = +1: min(1.5, 1.2) = 1.2            (clipped)
    #   t4: masked out; theta = behav = -inf must not leak a NaN.
    # L = -(1.1 - 1.8 + 1.0 + 1.2)/4 = -0.375; clip_ratio = 1/4; mean r = 4.9/4.
    theta = torch.tensor([math.log(1.1), math.log(0.9), math.log(0.25), math.log(0.75), -math.inf],
                         requires_grad=True)
    behav = torch.tensor([0.0, math.log(0.5), math.log(0.5), math.log(0.5), -math.inf])
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, 3.0])
    mask = torch.tensor([True, True, True, True, False])
    return theta, behav, adv, mask


def test_naive_ppo_loss_hand_values_and_gradient():
    theta, behav, adv, mask = _naive_tokens()
    loss, stats = naive_ppo_loss(theta, behav, adv, mask, eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(-0.375))
    torch.testing.assert_close(stats["clip_ratio"], torch.tensor(0.25))
    torch.testing.assert_close(stats["ratio"], torch.tensor(4.9 / 4))
    torch.testing.assert_close(stats["importance_weight"], torch.tensor(1.0))
    assert stats["behav_capped_ratio"].item() == 0.0 and stats["num_tokens"].item() == 4
    # behav_kl: mean of theta - behav = log(1.1 · 1.8 · 0.5 · 1.5)/4; approx_kl: mean of r - 1 - log r
    torch.testing.assert_close(stats["behav_kl"], torch.tensor(math.log(1.485) / 4))
    torch.testing.assert_close(stats["approx_kl"], torch.tensor((0.9 - math.log(1.485)) / 4))
    loss.backward()
    # unclipped: d/dθ(-A·r/4) = -A·r/4 (dr/dθ = r); t3 clipped: 0; t4 masked: 0.
    torch.testing.assert_close(theta.grad, torch.tensor([-1.1 / 4, 1.8 / 4, -1.0 / 4, 0.0, 0.0]))


def test_naive_ppo_loss_trust_region_is_around_behav_not_prox():
    # The same tokens under the decoupled loss with π_prox = π_θ (one update per step): every
    # r = 1, so nothing is clipped and each token's gradient is -w·A/4 with w = π_θ/π_behav (the
    # naive ratio; all w ≤ the cap 5), where naive PPO clips t3 (its ratio 1.5 is outside 1 ± 0.2).
    theta, behav, adv, mask = _naive_tokens()
    loss, stats = decoupled_ppo_loss(theta, theta.detach(), behav, adv, mask, 0.2, behav_imp_weight_cap=5.0)
    loss.backward()
    assert stats["clip_ratio"].item() == 0.0
    torch.testing.assert_close(theta.grad, torch.tensor([-1.1 / 4, 1.8 / 4, -1.0 / 4, -1.5 / 4, 0.0]))
    # a cap does not exist for naive PPO: a behaviour policy far behind is not masked
    theta, _, adv, mask = _naive_tokens()
    far = torch.full((5,), -20.0)
    _, stats = naive_ppo_loss(theta, far, adv, mask)
    assert stats["behav_capped_ratio"].item() == 0.0 and stats["importance_weight"].item() == 1.0


def test_naive_and_decoupled_coincide_when_behaviour_is_proximal():
    # η = 0 / fresh data: π_behav = π_prox makes w = 1, and Eq. 5 becomes PPO's L^CLIP: same loss,
    # gradient and statistics (behav_kl aside: the decoupled loss reports prox - behav = 0, the
    # naive one theta - behav, equal once π_θ = π_prox too).
    theta, behav, adv, mask = _naive_tokens()
    theta2 = theta.detach().clone().requires_grad_(True)
    d_loss, d = decoupled_ppo_loss(theta, behav, behav, adv, mask, 0.2, 0.28, behav_imp_weight_cap=5.0,
                                   num_tokens=6)
    n_loss, n = naive_ppo_loss(theta2, behav, adv, mask, 0.2, 0.28, num_tokens=6)
    torch.testing.assert_close(n_loss, d_loss, rtol=0, atol=0)
    d_loss.backward()
    n_loss.backward()
    torch.testing.assert_close(theta2.grad, theta.grad, rtol=0, atol=0)
    assert {k: v.item() for k, v in n.items() if k != "behav_kl"} == {k: v.item() for k, v in d.items()
                                                                    if k != "behav_kl"}
    fresh = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    same = fresh.detach()
    args = (torch.tensor([1.0, -2.0, 0.5]), torch.ones(3, dtype=torch.bool))
    _, d = decoupled_ppo_loss(fresh, same, same, *args, behav_imp_weight_cap=5.0)
    _, n = naive_ppo_loss(fresh, same, *args)
    assert {k: v.item() for k, v in n.items()} == {k: v.item() for k, v in d.items()}
    assert n["behav_kl"].item() == 0.0
