"""Group-relative advantages (GRPO; Shao et al., "DeepSeekMath", arXiv:2402.03300, §4.1.2).

    A_i = (R_i - mean(R_group)) / (std(R_group) + eps)   over the ``group_size`` responses to one prompt

Population std (``unbiased=False``), floored so that an all-equal group gets exactly 0, never NaN.
With γ = λ = 1 and one reward at the end every sampled token of sample i gets ``A_i``
(``trainer.plan``). Per-turn rewards are summed into R_i by default (``algo.turn_rewards``);
``turn_advantages`` is the alternative, GRPO's process supervision (DeepSeekMath §4.1.3): each
turn reward normalised over all turn rewards of its group, and a token of turn k gets the sum over
turns j ≥ k (reward to go, γ = 1), added to its episode's ``A_i``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages of ``rewards``, normalised within consecutive groups of ``group_size``.

    Args:
        rewards: ``[N] float`` sequence-level rewards; samples of one group are consecutive, so
            sample ``j`` belongs to group ``j // group_size``.
        group_size: ``n_samples`` per prompt; must divide ``N``.
        std_norm: divide by the group std (GRPO); ``False`` only centres (Dr. GRPO style).
        eps: added to the std, so the divisor is at least ``eps``; an all-equal group (std 0)
            gives exactly 0.

    Returns:
        ``[N]`` advantages in the dtype of ``rewards`` (float32 at least).

    Raises:
        ValueError: ``rewards`` is not 1-D, ``group_size < 1`` or does not divide ``N``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards "
            f"({rewards.numel()}); each group is the n_samples responses to one prompt"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.to(dtype).view(-1, group_size)  # [G, n]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_norm:
        std = grouped.std(dim=1, unbiased=False, keepdim=True)
        centred = centred / (std + eps)
    # All-equal groups: the mean of equal floats may round, so force exact zeros there.
    equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return centred.masked_fill(equal, 0.0).reshape(-1)


def batch_normalize(advantages: Tensor, mask: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Normalise advantages to zero mean and unit std over the whole batch (optional step).

    Used after ``group_advantages`` when ``algo.batch_norm`` is on (AReaL-boba's
    "global advantage normalisation"). Only entries where ``mask`` is true enter the statistics;
    masked-out entries are returned as 0.

    Args:
        advantages: ``[N] float`` (per sequence or per token).
        mask: ``[N] bool`` or ``None`` (all valid).
        eps: std floor.

    Returns:
        ``[N]`` normalised advantages; all zeros if no entry is valid or all are equal.
    """
    assert advantages.dim() == 1, f"advantages must be 1-D, got {tuple(advantages.shape)}"
    if mask is None:
        mask = torch.ones_like(advantages, dtype=torch.bool)
    assert mask.shape == advantages.shape, "mask and advantages must have the same shape"
    valid = advantages[mask]
    if valid.numel() == 0:
        return torch.zeros_like(advantages)
    mean = valid.mean()
    std = valid.std(unbiased=False)
    out = (advantages - mean) / (std + eps)
    if bool((valid == valid[0]).all()):
        out = torch.zeros_like(out)
    return out.masked_fill(~mask, 0.0)


def turn_advantages(turn_rewards: Tensor, turn_sample: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """Per-turn advantages from per-turn rewards: GRPO with process supervision (Shao et al.,
    "DeepSeekMath", arXiv:2402.03300, §4.1.3), turns as the steps, γ = 1:

        r̃_{i,k} = (r_{i,k} - mean(R_g)) / (std(R_g) + eps),   R_g = every turn reward of group g
        Â_{i,k} = Σ_{j ≥ k} r̃_{i,j}                           (reward to go within sample i)

    Every sampled token of turn k of sample i gets ``Â_{i,k}`` on top of its episode advantage
    (``group_advantages`` of the episode rewards; ``trainer.plan``). Population std, floored as in
    ``group_advantages``; a group whose turn rewards are all equal gets exactly 0.

    Args:
        turn_rewards: ``[K] float`` the turn rewards of the batch, packed: the turns of a sample
            consecutive and in order, samples ascending.
        turn_sample: ``[K] int64`` the sample (global index ``j``, group ``j // group_size``) of
            each turn, non-decreasing.
        group_size: samples per group (``n_samples``).

    Returns:
        ``[K]`` advantages in the dtype of ``turn_rewards`` (float32 at least).
    """
    assert turn_rewards.dim() == 1 and turn_rewards.shape == turn_sample.shape, (
        f"turn_rewards {tuple(turn_rewards.shape)} and turn_sample {tuple(turn_sample.shape)} must both be [K]")
    assert bool((turn_sample.diff() >= 0).all()), "turns must be packed by sample, samples ascending"
    dtype = torch.promote_types(turn_rewards.dtype, torch.float32)
    rewards = turn_rewards.to(dtype)
    normed = torch.zeros_like(rewards)
    group = turn_sample // group_size
    for g in group.unique().tolist():
        sel = group == g
        r = rewards[sel]
        if bool((r == r[0]).all()):
            continue  # all equal: exactly 0 (the mean of equal floats may round)
        normed[sel] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    counts = torch.unique_consecutive(turn_sample, return_counts=True)[1].tolist()
    return torch.cat([seg.flip(0).cumsum(0).flip(0) for seg in normed.split(counts)]) if counts else normed
