"""Group-relative advantages (GRPO; Shao et al., "DeepSeekMath", arXiv:2402.03300, §4.1.2).

    A_i = (R_i - mean(R_group)) / (std(R_group) + eps)   over the ``group_size`` responses to one prompt

Population std (``unbiased=False``), floored so that an all-equal group gets exactly 0, never NaN.
With γ = λ = 1 and one reward at the end every token of response i gets ``A_i`` (``trainer.plan``).
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
