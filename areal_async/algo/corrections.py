"""Off-policy corrections to compare with decoupled PPO, over packed token tensors.

Each loss is AReaL's Eq. 5 sum (``loss.weighted_clipped_loss``) with its own behaviour weight
w_t, a function of log w_t = prox_t - behav_t and never differentiated:

    tis     w_t = min(π_prox/π_behav, C)                          token-level truncated IS
    mis     w_t = ρ_b · 1[ρ_lo ≤ ρ_b ≤ ρ_hi],  ρ_b = Π_{t∈b} π_prox/π_behav   sequence-level masked IS
    icepop  w_t = π_prox/π_behav · 1[α ≤ π_prox/π_behav ≤ β]      token-level masking
    m2po    w_t = 1, or 0 on the tokens with the largest (log w_t)² until their mean is below τ
    gspo    decoupled PPO's w_t with GSPO's sequence-level ratio in place of r_t

Sources: TIS, Yao et al. "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025); MIS, Liu et al. "When Speed Kills Stability" (2025), seq-MIS; IcePop,
Ling team, Ring-1T (arXiv:2510.18855); M2PO, Zheng et al. arXiv:2510.01161;
GSPO, Zheng et al. arXiv:2507.18071 (its GSPO-token form). Masked tokens and
sequences stay in the token denominator (like the decoupled loss's cap): each call returns its
share of the global token mean, ``num_tokens`` as in ``decoupled_ppo_loss``. The sequence-level
quantities (ρ_b, GSPO's s_b) are sums over one sequence's loss tokens, given by ``cu_seqlens``;
the M2PO mask is chosen over the loss tokens of one call (one micro-batch), as AReaL does. How
each maps onto verl's, AReaL's and TRL's implementations: docs/objectives.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from areal_async.algo.loss import check_token_inputs, token_denominator, token_share, weighted_clipped_loss


def _inputs(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
            eps_clip: float) -> tuple[Tensor, Tensor]:
    """Check the ``[T]`` shapes; returns ``(mask [T] bool, log w [T] = prox - behav, 0 off the mask)``."""
    check_token_inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    mask = loss_mask.bool()
    log_w = torch.where(mask, prox_logp.detach() - behav_logp.detach(), torch.zeros_like(theta_logp))
    return mask, log_w.detach()


def _within(ratio: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """``(kept [T] bool: low ≤ ratio ≤ high, weight [T]: ratio where kept, else 0)``."""
    kept = (ratio >= low) & (ratio <= high)
    return kept, torch.where(kept, ratio, torch.zeros_like(ratio))


def _token_loss(theta_logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, log_w: Tensor,
                weight: Tensor, eps_clip: float, eps_clip_high: float | None,
                num_tokens: float | None) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Eq. 5 with token ratio r_t = π_θ/π_prox and the given ``weight``; returns the share function too."""
    denom = token_denominator(mask, num_tokens, theta_logp.dtype)
    log_ratio = torch.where(mask, theta_logp - prox_logp.detach(), torch.zeros_like(theta_logp))
    loss, stats = weighted_clipped_loss(torch.exp(log_ratio), log_ratio, advantages, mask, weight, eps_clip,
                                        eps_clip if eps_clip_high is None else eps_clip_high, denom)
    share = token_share(mask, denom)
    stats.update(behav_capped_ratio=share(torch.zeros_like(mask)), behav_kl=share(log_w))
    return loss, stats, share


def sequence_index(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """``[T] int64`` the sequence of each position, from ``cu_seqlens [B+1] int32`` covering ``[0, T)``."""
    assert cu_seqlens.dim() == 1 and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == num_tokens, (
        f"cu_seqlens must run from 0 to T={num_tokens}, got {cu_seqlens.tolist()}")
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def _sequence_sum(x: Tensor, seq: Tensor, num_seqs: int) -> Tensor:
    """``[B]`` Σ of ``x [T]`` (0 off the mask already) over each sequence's positions."""
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, x)


def tis_loss(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
             eps_clip: float = 0.2, eps_clip_high: float | None = None, imp_weight_cap: float = 2.0, *,
             num_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level truncated IS (TIS): Eq. 5 with w_t = min(π_prox/π_behav, C), C = ``imp_weight_cap``.

    Args: ``[T] float`` log-probs of θ (requires grad), prox and behav, ``advantages [T] float``,
    ``loss_mask [T] bool``, and ε, ε_high, ``num_tokens`` as ``decoupled_ppo_loss``.

    Returns:
        ``(loss, stats)``: ``decoupled_ppo_loss``'s keys (``behav_capped_ratio`` 0) and
        ``tis_truncated_ratio``, the share of loss tokens with π_prox/π_behav > C.
    """
    mask, log_w = _inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    raw = torch.exp(log_w)
    weight = raw.clamp(max=imp_weight_cap)
    loss, stats, share = _token_loss(theta_logp, prox_logp, advantages, mask, log_w, weight, eps_clip,
                                     eps_clip_high, num_tokens)
    stats["tis_truncated_ratio"] = share(raw > imp_weight_cap)
    return loss, stats


def mis_loss(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
             cu_seqlens: Tensor, eps_clip: float = 0.2, eps_clip_high: float | None = None,
             seq_ratio_low: float = 0.5, seq_ratio_high: float = 2.0, *,
             num_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level masked IS (seq-MIS): Eq. 5 with every token of sequence b weighted by
    ρ_b = exp(Σ_{t∈b} m_t (prox_t - behav_t)) when ``seq_ratio_low ≤ ρ_b ≤ seq_ratio_high``, else 0.

    Args: as ``tis_loss``, and ``cu_seqlens [B+1] int32`` the sequences of the ``[T]`` positions.

    Returns:
        ``(loss, stats)``: ``decoupled_ppo_loss``'s keys and ``mis_masked_ratio``, the share of
        loss tokens in masked sequences.
    """
    mask, log_w = _inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    seq = sequence_index(cu_seqlens, len(theta_logp))
    rho = torch.exp(_sequence_sum(log_w, seq, len(cu_seqlens) - 1))[seq]
    kept, weight = _within(rho, seq_ratio_low, seq_ratio_high)
    loss, stats, share = _token_loss(theta_logp, prox_logp, advantages, mask, log_w, weight, eps_clip,
                                     eps_clip_high, num_tokens)
    stats["mis_masked_ratio"] = share(~kept)
    return loss, stats


def icepop_loss(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
                eps_clip: float = 0.2, eps_clip_high: float | None = None, ratio_low: float = 0.5,
                ratio_high: float = 5.0, *, num_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop (Ring-1T, arXiv:2510.18855): Eq. 5 with w_t = k_t · 1[α ≤ k_t ≤ β], k_t = π_prox/π_behav,
    α = ``ratio_low``, β = ``ratio_high``.

    Args: as ``tis_loss``.

    Returns:
        ``(loss, stats)``: ``decoupled_ppo_loss``'s keys and ``icepop_masked_ratio``, the share of
        loss tokens with k_t outside [α, β].
    """
    mask, log_w = _inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    raw = torch.exp(log_w)
    kept, weight = _within(raw, ratio_low, ratio_high)
    loss, stats, share = _token_loss(theta_logp, prox_logp, advantages, mask, log_w, weight, eps_clip,
                                     eps_clip_high, num_tokens)
    stats["icepop_masked_ratio"] = share(~kept)
    return loss, stats


def m2po_kept(log_w: Tensor, mask: Tensor, m2_threshold: float) -> Tensor:
    """``[T] bool`` M2PO's kept loss tokens: drop those with the largest (log w_t)² until the mean
    (log w)² of the rest is below τ = ``m2_threshold`` (at least one token is kept; ties in the
    order of position, a stable sort)."""
    m2 = log_w[mask].square()
    n = m2.numel()
    kept = mask.clone()
    if n == 0:
        return kept
    ordered, order = torch.sort(m2, descending=True, stable=True)
    rest_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
    below = rest_mean < m2_threshold
    drop = int(below.int().argmax()) if bool(below.any()) else n - 1
    kept_sorted = torch.arange(n, device=m2.device) >= drop
    kept[mask] = torch.empty_like(kept_sorted).scatter_(0, order, kept_sorted)
    return kept


def m2po_loss(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
              eps_clip: float = 0.2, eps_clip_high: float | None = None, m2_threshold: float = 0.04, *,
              num_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO (arXiv:2510.01161; as AReaL's ``m2_threshold``): Eq. 5 with w_t = 1 on the
    tokens ``m2po_kept`` keeps and 0 on the others; the second moment M2 = mean (log π_prox/π_behav)²
    of the kept tokens is below τ = ``m2_threshold``.

    Args: as ``tis_loss``.

    Returns:
        ``(loss, stats)``: ``decoupled_ppo_loss``'s keys, ``m2po_masked_ratio`` (share of loss
        tokens dropped) and ``m2po_m2`` (M2 over all loss tokens, before the mask).
    """
    mask, log_w = _inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    kept = m2po_kept(log_w, mask, m2_threshold)
    weight = kept.to(theta_logp.dtype)
    loss, stats, share = _token_loss(theta_logp, prox_logp, advantages, mask, log_w, weight, eps_clip,
                                     eps_clip_high, num_tokens)
    stats.update(m2po_masked_ratio=share(~kept), m2po_m2=share(log_w.square()))
    return loss, stats


def gspo_loss(theta_logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
              cu_seqlens: Tensor, eps_clip: float = 3e-4, eps_clip_high: float | None = 4e-4,
              behav_imp_weight_cap: float | None = None, *,
              num_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (arXiv:2507.18071): Eq. 5 with r_t replaced by
    s_{b,t} = sg[s_b] · π_θ(y_t)/sg[π_θ(y_t)], s_b = exp(mean_{t∈b} log π_θ/π_prox) the geometric
    mean over sequence b's loss tokens (so the clip acts per sequence), and decoupled PPO's w_t
    (π_prox/π_behav, 0 above ``behav_imp_weight_cap``).

    Args: as ``tis_loss`` and ``cu_seqlens [B+1] int32``; ε, ε_high default to GSPO's 3e-4, 4e-4.

    Returns:
        ``(loss, stats)`` with ``decoupled_ppo_loss``'s keys; ``ratio``, ``clip_ratio`` and
        ``approx_kl`` of s_{b,t}.
    """
    mask, log_w = _inputs(theta_logp, prox_logp, behav_logp, advantages, loss_mask, eps_clip)
    denom = token_denominator(mask, num_tokens, theta_logp.dtype)
    seq = sequence_index(cu_seqlens, len(theta_logp))
    num_seqs = len(cu_seqlens) - 1
    log_r = torch.where(mask, theta_logp.detach() - prox_logp.detach(), torch.zeros_like(theta_logp))
    count = _sequence_sum(mask.to(theta_logp.dtype), seq, num_seqs).clamp_min(1.0)
    log_s = (_sequence_sum(log_r, seq, num_seqs) / count)[seq]
    log_ratio = torch.where(mask, theta_logp - theta_logp.detach() + log_s, torch.zeros_like(theta_logp))
    raw = torch.exp(log_w)
    capped = mask & (raw > behav_imp_weight_cap) if behav_imp_weight_cap is not None else torch.zeros_like(mask)
    weight = raw.masked_fill(capped, 0.0)
    loss, stats = weighted_clipped_loss(torch.exp(log_ratio), log_ratio, advantages, mask, weight, eps_clip,
                                        eps_clip if eps_clip_high is None else eps_clip_high, denom)
    share = token_share(mask, denom)
    stats.update(behav_capped_ratio=share(capped), behav_kl=share(log_w))
    return loss, stats
