"""Behaviour vs trainer log-probs (``algo/mismatch.py``) against hand-derived values.

The definitions are verl's (``rollout_corr_helper.compute_offpolicy_metrics`` and the token-level
``compute_is_metrics``); verl itself is not imported here: its module pulls in ray, tensordict and
omegaconf through ``verl.protocol`` (docs/metrics.md, "Mismatch").
"""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.algo.mismatch import IS_THRESHOLD, mismatch, mismatch_metrics, mismatch_sums

LN3, LN4 = math.log(3.0), math.log(4.0)


def _case():
    # 3 sequences: [0, 2), [2, 4), [4, 5). Token 2 is off the mask (a prompt or tool token; its
    # garbage 7.0 must not count), sequence 2 has no masked token at all (not a sequence of the
    # sequence means). log ρ = train − behav on the masked tokens 0, 1, 3: [0, ln 3, −ln 4], so
    # ρ = [1, 3, 1/4]: one weight above U = 2, one below 1/U = 1/2.
    behav = torch.tensor([-1.0, -2.0, 0.0, -0.5, -3.0])
    train = torch.tensor([-1.0, -2.0 + LN3, 7.0, -0.5 - LN4, -9.0])
    mask = torch.tensor([True, True, False, True, False])
    cu = torch.tensor([0, 2, 4, 5], dtype=torch.int32)
    return behav, train, mask, cu


def test_hand_values():
    behav, train, mask, cu = _case()
    fresh = torch.tensor([True, True, True, False, True])  # & mask: tokens 0 and 1
    got = mismatch(behav, train, mask, cu, fresh)
    assert IS_THRESHOLD == 2.0
    # sequence 0: mean train (−1 − 2 + ln 3)/2, mean behav −1.5, d = mean behav − mean train = −ln3/2,
    # Σ log ρ = ln 3; sequence 1: mean train −0.5 − ln 4, mean behav −0.5, d = ln 4, Σ log ρ = −ln 4
    d = [-LN3 / 2, LN4]
    want = {
        "logprob_diff_tokens": 2.0, "logprob_diff_mean": LN3 / 2, "logprob_diff_max": LN3,
        "mismatch/tokens": 3.0, "mismatch/seqs": 2.0,
        "mismatch/kl": (0.0 - LN3 + LN4) / 3,
        "mismatch/k3_kl": ((1 - 1 - 0) + (3 - 1 - LN3) + (0.25 - 1 + LN4)) / 3,
        "mismatch/chi2_token": (1 + 9 + 1 / 16) / 3 - 1,
        "mismatch/chi2_seq": (3.0**2 + 0.25**2) / 2 - 1,
        "mismatch/training_ppl": (math.exp((3 - LN3) / 2) + math.exp(0.5 + LN4)) / 2,
        "mismatch/rollout_ppl": (math.exp(1.5) + math.exp(0.5)) / 2,
        "mismatch/log_ppl_diff": sum(d) / 2, "mismatch/log_ppl_abs_diff": (LN3 / 2 + LN4) / 2,
        "mismatch/log_ppl_diff_max": LN4, "mismatch/log_ppl_diff_min": -LN3 / 2,
        "mismatch/ppl_ratio": (3**-0.5 + 4) / 2,
        # w = min(ρ, 2) = [1, 2, 1/4]: ESS = E[w]² / E[w²]
        "mismatch/ess": (3.25 / 3) ** 2 / ((1 + 4 + 1 / 16) / 3),
        "mismatch/is_fraction_high": 1 / 3, "mismatch/is_fraction_low": 1 / 3,
    }
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    # the whole mask counts for logprob_diff_* without fresh
    assert mismatch(behav, train, mask, cu)["logprob_diff_max"] == pytest.approx(LN4, rel=1e-6)


def test_equal_logprobs_give_exact_zeros():
    behav, _, mask, cu = _case()
    got = mismatch(behav, behav.clone(), mask, cu)
    assert got["logprob_diff_tokens"] == 3 and got["logprob_diff_max"] == 0.0 and got["logprob_diff_mean"] == 0.0
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff", "is_fraction_high",
              "is_fraction_low"):
        assert got[f"mismatch/{k}"] == 0.0, k
    assert got["mismatch/ess"] == 1.0 and got["mismatch/ppl_ratio"] == 1.0
    assert got["mismatch/training_ppl"] == got["mismatch/rollout_ppl"]


def test_sums_add_over_micro_batches():
    # a step sums micro-batches (and ranks) before dividing: the metrics of two halves' summed
    # sums (maxima: max) are those of the whole, not a mean of the halves' means
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3, 9, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    behav = -torch.rand(n, generator=gen) * 5
    train = behav + torch.randn(n, generator=gen) * 0.7
    mask = torch.rand(n, generator=gen) > 0.3
    whole = mismatch(behav, train, mask, cu)
    cut = int(cu[3])  # after the third sequence
    parts = [mismatch_sums(behav[:cut], train[:cut], mask[:cut], cu[:4]),
             mismatch_sums(behav[cut:], train[cut:], mask[cut:], cu[3:] - cut)]
    got = mismatch_metrics((parts[0][0] + parts[1][0]).tolist(), torch.maximum(parts[0][1], parts[1][1]).tolist())
    assert set(got) == set(whole)
    for k, v in whole.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_nothing_to_compare_leaves_the_means_out():
    behav, train, _, cu = _case()
    none = torch.zeros(5, dtype=torch.bool)
    assert mismatch(behav, train, none, cu) == {"logprob_diff_tokens": 0.0, "mismatch/tokens": 0.0,
                                                "mismatch/seqs": 0.0}
    got = mismatch(behav, train, _case()[2], cu, fresh=none)
    assert got["logprob_diff_tokens"] == 0.0 and "logprob_diff_max" not in got and "mismatch/kl" in got
