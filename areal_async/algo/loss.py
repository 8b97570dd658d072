"""The decoupled PPO loss of AReaL over packed token tensors, and its naive-PPO control.

AReaL (Fu et al., arXiv:2505.24298, §5.2, Eq. 5) anchors the trust region on the *proximal* policy
(the trainer's before this update), not the *behaviour* policy that generated the tokens:

    L(θ) = -Σ_t m_t · w_t · min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t) / Σ_t m_t
    r_t = π_θ(y_t) / π_prox(y_t) = exp(theta_t - prox_t)
    w_t = π_prox(y_t) / π_behav(y_t) = exp(prox_t - behav_t)   (no gradient)

w_t > ``behav_imp_weight_cap``: w_t = 0, still in the denominator (AReaL's code). Log-probs of the
temperature-scaled distribution; no KL term. With ``num_tokens`` = the step's loss tokens (all
micro-batches and ranks) each call returns its share of the global token mean (R ranks averaging
gradients need the loss scaled by R). ``naive_ppo_loss``: the control, π_prox := π_behav.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_token_inputs(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor,
                       loss_mask: Tensor, eps_clip: float) -> None:
    """Assert a token loss's inputs: ``theta_logp [T]`` and the other four of its shape, ``eps_clip > 0``."""
    shape = theta_logp.shape
    assert theta_logp.dim() == 1, f"theta_logp must be [T], got {tuple(shape)}"
    others = {"prox_logp": prox_logp, "behav_logp": behav_logp, "advantages": advantages, "loss_mask": loss_mask}
    for name, t in others.items():
        assert t.shape == shape, f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like theta_logp"
    assert eps_clip > 0, f"eps_clip must be > 0, got {eps_clip}"


def decoupled_ppo_loss(
    theta_logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_weight_cap: float | None = None,
    *,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled-PPO policy loss (AReaL Eq. 5) over ``T`` packed tokens.

    Args:
        theta_logp: ``[T] float`` log π_θ of each token (requires grad).
        prox_logp: ``[T] float`` log π_prox, recomputed by the trainer before the update.
        behav_logp: ``[T] float`` log π_behav as returned by the inference server.
        advantages: ``[T] float`` per-token advantages.
        loss_mask: ``[T] bool`` (or 0/1) — true on response tokens that enter the loss.
        eps_clip: ε, lower clip ``1-ε`` (and upper when ``eps_clip_high`` is ``None``).
        eps_clip_high: ε_high for the upper clip ``1+ε_high`` (DAPO's clip-higher); ``None`` = ε.
        behav_imp_weight_cap: c; tokens with w_t > c get weight 0. ``None`` = no cap.
        num_tokens: the denominator; ``None`` = ``Σ loss_mask`` of this call. Floored at 1, so
            an empty mask gives a loss of exactly 0 (with a zero gradient), never NaN.

    Returns:
        ``(loss, stats)``: ``loss`` a scalar tensor; ``stats`` detached scalars, each a sum over
        masked tokens divided by the same denominator: ``clip_ratio`` (tokens where the clipped
        term is the active one), ``importance_weight`` (w_t after the cap), ``behav_capped_ratio``
        (tokens dropped by the cap), ``ratio`` (r_t), ``approx_kl`` (k3 estimate of KL(π_prox‖π_θ),
        (r-1) - log r), ``behav_kl`` (log w_t = prox_t - behav_t before the cap, a measure of how
        far the behaviour policy lags), ``num_tokens`` (Σ loss_mask of this call, not normalised).
    """
    check_token_inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    mask = loss_mask.bool()
    denom = token_denominator(mask, num_tokens, theta_logp.dtype)

    # torch.where, not multiplication, so garbage outside the mask (e.g. -inf) never makes NaN.
    prox = prox_logp.detach()
    log_ratio = torch.where(mask, theta_logp - prox, torch.zeros_like(theta_logp))
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        behav_log_w = torch.where(mask, prox - behav_logp.detach(), torch.zeros_like(prox))
        weight = torch.exp(behav_log_w)
        capped = torch.zeros_like(mask)
        if behav_imp_weight_cap is not None:
            capped = mask & (weight > behav_imp_weight_cap)
            weight = weight.masked_fill(capped, 0.0)

    loss, stats = weighted_clipped_loss(ratio, log_ratio, advantages, mask, weight, eps_clip, eps_high, denom)
    with torch.no_grad():
        share = token_share(mask, denom)
        stats.update(behav_capped_ratio=share(capped), behav_kl=share(behav_log_w))
    return loss, stats


def token_denominator(loss_mask: Tensor, num_tokens: float | None, dtype: torch.dtype) -> Tensor:
    """The loss's denominator: ``num_tokens``, or ``Σ loss_mask`` when ``None``; floored at 1."""
    count = loss_mask.bool().sum()
    denom = count if num_tokens is None else torch.tensor(float(num_tokens))
    return denom.to(dtype).clamp_min(1.0)


def token_share(mask: Tensor, denom: Tensor):
    """``share(x)``: ``Σ_t m_t x_t / denom`` of a ``[T]`` tensor ``x`` (booleans count 1), detached."""
    m = mask.to(denom.dtype)
    return lambda x: (x.detach().to(denom.dtype) * m).sum() / denom


def weighted_clipped_loss(ratio: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, weight: Tensor,
                          eps_clip: float, eps_high: float, denom: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``-Σ_t m_t · w_t · min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t) / denom`` (AReaL Eq. 5's sum).

    Args:
        ratio: ``[T] float`` r_t (carries the gradient), ``log_ratio`` its log; both 0-safe off the mask.
        advantages: ``[T] float``; ``mask``: ``[T] bool`` loss mask; ``weight``: ``[T]`` w_t, no grad.
        denom: scalar tensor, the token denominator (``token_denominator``).

    Returns:
        ``(loss, stats)``, stats shares of ``denom``: loss, clip_ratio, importance_weight (w_t),
        ratio, approx_kl (k3 of r_t), num_tokens (Σ mask, not normalised).
    """
    adv = advantages.detach().to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped) * weight  # = -w·min(rA, clip(r)A)
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / denom

    with torch.no_grad():
        share = token_share(mask, denom)
        stats = {
            "loss": loss.detach(),
            "clip_ratio": share(clipped > unclipped),
            "importance_weight": share(weight),
            "ratio": share(ratio),
            "approx_kl": share(ratio - 1.0 - log_ratio),
            "num_tokens": mask.sum().to(ratio.dtype),
        }
    return loss, stats


def naive_ppo_loss(
    theta_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    *,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Naive-PPO policy loss over ``T`` packed tokens: PPO's L^CLIP (arXiv:1707.06347, Eq. 7) on
    possibly stale data, π_old = π_behav; AReaL's Eq. 5 with π_prox := π_behav (arXiv:2505.24298,
    the "naive PPO" baseline of its staleness ablation):

        L(θ) = -Σ_t m_t · min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t) / Σ_t m_t,
        r_t = π_θ(y_t) / π_behav(y_t) = exp(theta_t - behav_t)

    Args:
        theta_logp: ``[T] float`` log π_θ of each token (requires grad).
        behav_logp: ``[T] float`` log π_behav as returned by the inference server.
        advantages, loss_mask, eps_clip, eps_clip_high, num_tokens: as ``decoupled_ppo_loss``.
            There is no importance weight, hence no cap.

    Returns:
        ``(loss, stats)`` with ``decoupled_ppo_loss``'s keys and normalisation: ``clip_ratio`` and
        ``ratio`` of r_t above, ``approx_kl`` the k3 estimate of KL(π_behav‖π_θ),
        ``importance_weight`` 1 and ``behav_capped_ratio`` 0 on every token (w_t = 1), and
        ``behav_kl`` = theta_t - behav_t (detached): how far π_behav lags the policy of this
        forward, the same quantity the decoupled loss reports when π_θ = π_prox (one update per
        step); a diagnostic only, in no term of the loss.
    """
    assert behav_logp.shape == theta_logp.shape, (
        f"behav_logp has shape {tuple(behav_logp.shape)}, expected {tuple(theta_logp.shape)} like theta_logp")
    loss, stats = decoupled_ppo_loss(theta_logp, behav_logp, behav_logp, advantages, loss_mask, eps_clip,
                                     eps_clip_high, None, num_tokens=num_tokens)
    with torch.no_grad():
        mask = loss_mask.bool()
        denom = token_denominator(mask, num_tokens, theta_logp.dtype)
        lag = torch.where(mask, theta_logp.detach() - behav_logp.detach(), torch.zeros_like(theta_logp))
        stats["behav_kl"] = lag.sum() / denom
    return loss, stats
