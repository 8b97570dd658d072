"""Training–inference mismatch diagnostics over packed tokens: behaviour vs trainer log-probs.

``behav [T]`` is log π_behav, what the inference engine returned with each sampled token; ``train
[T]`` the trainer's log-probs of the same tokens (π_prox: the policy the trainer holds before the
step's first update); ``mask [T]`` the loss mask; ``cu_seqlens [B+1]`` the sequences' boundaries
in the same layout. ρ_t = π_train/π_behav = exp(train_t − behav_t). Two families:

* **log-prob agreement** (``fresh``: the tokens sampled by the very weights the trainer holds):
  ``logprob_diff_{tokens, mean, max}``, the count, mean and max of |train_t − behav_t| over them.
  With the same weights, a difference is numerics only (kernels, reduction order, dtype); it is 0
  only where engine and trainer compute bitwise alike (docs/metrics.md, "Engine vs trainer").
* **mismatch** (every masked token, whatever version sampled it, so staleness is included): the
  diagnostics verl logs as ``rollout_corr/*`` (``verl/trainer/ppo/rollout_corr_helper.py``,
  ``compute_offpolicy_metrics``, and ``compute_is_metrics`` at token level), same definitions,
  names kept: token means ``kl`` = E[behav − train] (the direct estimate of KL(π_behav‖π_train)),
  ``k3_kl`` = E[ρ − 1 − log ρ], ``chi2_token`` = E[ρ̃²] − 1; sequence means (over sequences
  with a masked token) ``chi2_seq`` = E_s[exp(2·clamp(Σ_t log ρ_t))] − 1, ``training_ppl`` and
  ``rollout_ppl`` = E_s[exp(−mean_t logp)], ``log_ppl_diff`` = E_s[d_s] with d_s = mean_t behav −
  mean_t train, ``log_ppl_abs_diff`` = E_s|d_s|, ``log_ppl_diff_{max, min}``, ``ppl_ratio`` =
  E_s[exp d_s]; importance weights with verl's default truncation U = ``IS_THRESHOLD`` (TIS, lower
  bound 1/U): ``ess`` = E[w]²/E[w²] with w = min(ρ̃, U) (verl's ``rollout_is_eff_sample_size``, a
  fraction in (0, 1]), ``is_fraction_high`` = P[ρ̃ > U], ``is_fraction_low`` = P[ρ̃ < 1/U]. ρ̃ =
  exp(clamp(log ρ, ±``SAFETY_BOUND``)), as verl; ``k3_kl`` is not clamped (verl's is not either).

Everything is computed in float64 from the inputs. ``mismatch_sums`` gives sums that add over
micro-batches and ranks (all-reduce SUM) and maxima (all-reduce MAX); ``mismatch_metrics`` turns
the totals into the metrics, so a step's values are over all its tokens and sequences, not means
of per-micro-batch means. Pure functions: no host synchronisation in ``mismatch_sums``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

IS_THRESHOLD = 2.0  # verl's default rollout_is_threshold (TIS upper bound; lower = 1 / it)
SAFETY_BOUND = 20.0  # |log ρ| clamp before exp, verl's SAFETY_BOUND

SUM_KEYS = ("diff_tokens", "diff_abs", "tokens", "kl", "k3_kl", "rho_sq", "w", "w_sq", "above", "below",
            "seqs", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "rho_sq_seq")
MAX_KEYS = ("diff_max", "log_ppl_diff_max", "neg_log_ppl_diff_min")


def mismatch_sums(behav: Tensor, train: Tensor, mask: Tensor, cu_seqlens: Tensor, fresh: Tensor | None = None,
                  threshold: float = IS_THRESHOLD) -> tuple[Tensor, Tensor]:
    """Additive sums and maxima of one packed batch (see the module docstring).

    Args:
        behav, train: ``[T] float`` log-probs (behaviour, trainer), any values off the mask.
        mask: ``[T] bool`` (or 0/1) the tokens compared.
        cu_seqlens: ``[B+1] int`` sequence ``b`` is ``[cu[b], cu[b+1])``; covers ``[0, T)``.
        fresh: ``[T] bool`` the tokens of ``mask`` that count for ``logprob_diff_*``; ``None`` =
            all of ``mask``.
        threshold: U, the importance-weight truncation bound (lower bound 1/U).

    Returns:
        ``(sums [len(SUM_KEYS)] float64, maxes [len(MAX_KEYS)] float64)`` on the inputs' device;
        a maximum over nothing is -inf.
    """
    assert behav.shape == train.shape == mask.shape and behav.dim() == 1, (
        f"behav {tuple(behav.shape)}, train {tuple(train.shape)}, mask {tuple(mask.shape)} must be the same [T]")
    m = mask.bool()
    f = m if fresh is None else m & fresh.bool()
    b, t = behav.detach().double(), train.detach().double()
    zero = torch.zeros_like(b)
    neg_inf = torch.full((1,), float("-inf"), dtype=torch.float64, device=b.device)
    log_ratio = torch.where(m, t - b, zero)  # log ρ (t − b of two float32 values is exact in float64)
    rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()  # ρ̃
    w = rho.clamp(max=threshold)
    diff = torch.where(f, log_ratio.abs(), zero)

    def tokens(x: Tensor) -> Tensor:
        return torch.where(m, x.to(torch.float64), zero).sum()

    cu = cu_seqlens.long()

    def per_seq(x: Tensor) -> Tensor:  # [B] Σ over each sequence's masked tokens (a cumsum: deterministic)
        cs = F.pad(torch.where(m, x.to(torch.float64), zero).cumsum(0), (1, 0))
        return cs[cu[1:]] - cs[cu[:-1]]

    n = per_seq(torch.ones_like(b))
    valid = n > 0
    mean_t, mean_b = per_seq(t) / n.clamp(min=1), per_seq(b) / n.clamp(min=1)
    d = mean_b - mean_t  # log ppl_train − log ppl_behav
    seq_log_ratio = per_seq(log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)

    def seqs(x: Tensor) -> Tensor:
        return torch.where(valid, x, torch.zeros_like(x)).sum()

    sums = {
        "diff_tokens": f.sum().to(torch.float64), "diff_abs": diff.sum(),
        "tokens": m.sum().to(torch.float64), "kl": tokens(-log_ratio), "k3_kl": tokens(log_ratio.exp() - 1 - log_ratio),
        "rho_sq": tokens(rho.square()), "w": tokens(w), "w_sq": tokens(w.square()),
        "above": tokens(rho > threshold), "below": tokens(rho < 1.0 / threshold),
        "seqs": valid.sum().to(torch.float64), "training_ppl": seqs((-mean_t).exp()),
        "rollout_ppl": seqs((-mean_b).exp()), "log_ppl_diff": seqs(d), "log_ppl_abs_diff": seqs(d.abs()),
        "ppl_ratio": seqs(d.exp()), "rho_sq_seq": seqs((2 * seq_log_ratio).exp()),
    }
    maxes = {
        "diff_max": torch.cat([torch.where(f, diff, neg_inf), neg_inf]).max(),
        "log_ppl_diff_max": torch.cat([torch.where(valid, d, neg_inf), neg_inf]).max(),
        "neg_log_ppl_diff_min": torch.cat([torch.where(valid, -d, neg_inf), neg_inf]).max(),
    }
    return torch.stack([sums[k] for k in SUM_KEYS]), torch.stack([maxes[k] for k in MAX_KEYS])


def mismatch_metrics(sums: Sequence[float], maxes: Sequence[float]) -> dict[str, float]:
    """The metrics of totals ``sums`` / ``maxes`` (``mismatch_sums``' order, summed and maxed over
    micro-batches and ranks), named as under ``train/``: ``logprob_diff_{tokens, mean, max}`` and
    ``mismatch/{tokens, seqs, kl, k3_kl, chi2_token, chi2_seq, training_ppl, rollout_ppl,
    log_ppl_diff, log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, ess,
    is_fraction_high, is_fraction_low}``. The counts are always there; a mean with nothing to
    average (no fresh token, no token, no sequence) is left out rather than reported as 0."""
    s, mx = dict(zip(SUM_KEYS, map(float, sums), strict=True)), dict(zip(MAX_KEYS, map(float, maxes), strict=True))
    out = {"logprob_diff_tokens": s["diff_tokens"], "mismatch/tokens": s["tokens"], "mismatch/seqs": s["seqs"]}
    if s["diff_tokens"]:
        out.update(logprob_diff_mean=s["diff_abs"] / s["diff_tokens"], logprob_diff_max=mx["diff_max"])
    if n := s["tokens"]:
        mean_w = s["w"] / n
        out.update({"mismatch/kl": s["kl"] / n, "mismatch/k3_kl": s["k3_kl"] / n,
                    "mismatch/chi2_token": s["rho_sq"] / n - 1.0,
                    "mismatch/ess": mean_w * mean_w / (s["w_sq"] / n) if s["w_sq"] else 0.0,
                    "mismatch/is_fraction_high": s["above"] / n, "mismatch/is_fraction_low": s["below"] / n})
    if k := s["seqs"]:
        out.update({"mismatch/chi2_seq": s["rho_sq_seq"] / k - 1.0, "mismatch/training_ppl": s["training_ppl"] / k,
                    "mismatch/rollout_ppl": s["rollout_ppl"] / k, "mismatch/log_ppl_diff": s["log_ppl_diff"] / k,
                    "mismatch/log_ppl_abs_diff": s["log_ppl_abs_diff"] / k,
                    "mismatch/log_ppl_diff_max": mx["log_ppl_diff_max"],
                    "mismatch/log_ppl_diff_min": -mx["neg_log_ppl_diff_min"], "mismatch/ppl_ratio": s["ppl_ratio"] / k})
    return out


def mismatch(behav: Tensor, train: Tensor, mask: Tensor, cu_seqlens: Tensor, fresh: Tensor | None = None,
             threshold: float = IS_THRESHOLD) -> dict[str, float]:
    """``mismatch_metrics`` of one batch (``mismatch_sums``' arguments); reads the device once."""
    sums, maxes = mismatch_sums(behav, train, mask, cu_seqlens, fresh, threshold)
    return mismatch_metrics(sums.cpu().tolist(), maxes.cpu().tolist())
