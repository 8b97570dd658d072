"""Each objective of ``algo.objective`` against the peers' own implementations (verl 0.9.1, AReaL
1.0.4, TRL 1.16.0), on random packed cases: loss value and gradient w.r.t. the θ log-probs.

A case: 1-6 sequences of 1-12 positions, ~80 % of them loss tokens, per-token advantages, θ near
π_prox and π_prox at a gap of 0.05, 0.3 or 1 nats (per token, normal) from π_behav, so that caps,
masks and clips are each hit in some cases and not in others; off the mask, arbitrary values.
verl works on ``[B, L]`` padded tensors: the packed ones are scattered into them (the gradient
flows back). Aggregation: ours is the token mean over the loss tokens of the call; verl's
``token-mean`` with ``batch_num_tokens`` = Σ loss mask, AReaL's ``ppo_actor_loss_fn`` (the
count of its input mask), TRL's ``bnpo`` loss type. verl's dual clip is disabled (``clip_ratio_c`` 1e9): it is not in
these losses. float64 at 1e-10 (AReaL's behaviour weights: float32's 2e-6, it computes them in
float32), every fourth case again in float32 at 1e-5. The peers' packages:
``bash tools/peers/install.sh`` (without them these tests fail, naming it).
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import NamedTuple

import pytest
import torch

from areal_async.algo.corrections import gspo_loss, icepop_loss, m2po_loss, mis_loss, tis_loss
from areal_async.algo.loss import decoupled_ppo_loss, naive_ppo_loss
from tests.support import peers

CASES = 100
GAPS = (0.05, 0.3, 1.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: intra-op threads only contend (repeat_interleave took 16 ms a call with them)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def verl():
    return peers.verl()


@pytest.fixture(scope="module")
def areal():
    return peers.areal()


@pytest.fixture(scope="module")
def trl():
    return peers.trl()


class Case(NamedTuple):
    theta: torch.Tensor  # [T], leaf with grad
    prox: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor  # [T] bool, ≥ 1 true
    cu_seqlens: torch.Tensor  # [B+1] int32
    seq: torch.Tensor  # [T] int64 sequence of each position
    pos: torch.Tensor  # [T] int64 position within it


def make_case(seed: int, dtype: torch.dtype, seq_constant_adv: bool = False) -> Case:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
    total = int(lengths.sum())
    seq = torch.tensor([b for b, n in enumerate(lengths.tolist()) for _ in range(n)])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    pos = torch.arange(total) - starts[seq]
    mask = torch.rand(total, generator=g) < 0.8
    mask[int(torch.randint(0, total, (1,), generator=g))] = True
    behav = -3.0 * torch.rand(total, generator=g, dtype=torch.float64)
    prox = behav + GAPS[seed % 3] * torch.randn(total, generator=g, dtype=torch.float64)
    theta = prox + 0.1 * torch.randn(total, generator=g, dtype=torch.float64)
    adv = torch.randn(total, generator=g, dtype=torch.float64)
    if seq_constant_adv:
        adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)[seq]
    off = ~mask  # what lies off the loss mask never matters
    theta, prox, behav = (torch.where(off, -5.0 * torch.rand(total, generator=g, dtype=torch.float64), x)
                          for x in (theta, prox, behav))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    return Case(theta.to(dtype).requires_grad_(), prox.to(dtype), behav.to(dtype), adv.to(dtype), mask, cu, seq, pos)


def padded(c: Case, x: torch.Tensor) -> torch.Tensor:
    """``[T]`` → verl's ``[B, L]`` (0 on padding; differentiable)."""
    out = x.new_zeros(len(c.cu_seqlens) - 1, int(c.cu_seqlens.diff().max()))
    return out.index_put((c.seq, c.pos), x)


def each_case(compare, seq_constant_adv: bool = False):
    """Run ``compare(case, tol)`` on ``CASES`` float64 cases and every fourth again in float32."""
    for seed in range(CASES):
        compare(make_case(seed, torch.float64, seq_constant_adv), dict(rtol=1e-10, atol=1e-12))
        if seed % 4 == 0:
            compare(make_case(seed, torch.float32, seq_constant_adv), dict(rtol=1e-5, atol=1e-6))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, theta: torch.Tensor, tol: dict, scale: float = 1.0):
    """Equal loss and gradient w.r.t. θ (``theirs`` times ``scale``)."""
    g_ours, = torch.autograd.grad(ours, theta)
    g_theirs, = torch.autograd.grad(theirs, theta)
    torch.testing.assert_close(ours, theirs.detach() * scale, **tol)
    torch.testing.assert_close(g_ours, g_theirs * scale, **tol)


def verl_config(core, eps: float, eps_high: float, c: Case):
    config = peers.VerlActorConfig(eps, eps, eps_high, clip_ratio_c=1e9)
    config.global_batch_info = {"batch_num_tokens": c.mask.sum().to(c.theta.dtype)}
    return config


def verl_weighs(c: Case, low: float, high: float) -> bool:
    """Whether a loss token keeps a weight in [low, high]: verl's weight metrics divide by zero
    when none does (its loss is then 0, as ours)."""
    w = torch.exp(c.prox - c.behav)
    return bool((c.mask & (w >= low) & (w <= high)).any())


def verl_weights(helper, c: Case, level: str, threshold):
    """verl's rollout-correction weights of log π_prox/π_behav, ``[B, L]``."""
    mask = padded(c, c.mask.to(c.theta.dtype))
    w, _ = helper.compute_rollout_correction_weights(padded(c, c.prox - c.behav), mask, level, threshold)
    return w


def verl_vanilla(core, c: Case, old: torch.Tensor, eps: float, eps_high: float, weights=None, mask=None):
    m = padded(c, c.mask.to(c.theta.dtype)) if mask is None else mask
    loss, _ = core.compute_policy_loss_vanilla(padded(c, old), padded(c, c.theta), padded(c, c.adv), m,
                                               "token-mean", verl_config(core, eps, eps_high, c), weights)
    return loss


# AReaL computes the behaviour weight π_prox/π_behav of its rejection sampling in float32 (it
# upcasts the log-probs with ``.float()``): with it, float32 precision in float64 cases too
AREAL_W_TOL = dict(rtol=2e-6, atol=1e-7)


def areal_loss(functional, c: Case, prox: torch.Tensor, eps: float, eps_high: float, rejection=None,
               mask=None, level: str = "token"):
    loss, _ = functional.ppo_actor_loss_fn(c.theta, prox, c.behav, c.adv, eps, c.mask if mask is None else mask,
                                           eps_high, None, rejection, level, c.cu_seqlens)
    return loss


def trl_loss(trl, c: Case, old: torch.Tensor, eps: float, eps_high: float, level: str) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` with ``loss_type="bnpo"`` (the token mean over the batch),
    per-token advantages ``[B, L]``, no KL, no vLLM weights, no entropy mask; ``self`` holds just
    what the method reads, and its θ log-probs are ``c.theta`` padded."""
    theta = padded(c, c.theta)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (theta, torch.zeros_like(theta), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type="bnpo", epsilon_low=eps, epsilon_high=eps_high,
        args=types.SimpleNamespace(delta=None), use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=types.SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x))
    ids = torch.zeros(theta.shape, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": torch.ones_like(ids[:, :1]), "completion_ids": ids,
              "completion_mask": padded(c, c.mask.to(c.theta.dtype)), "advantages": padded(c, c.adv),
              "old_per_token_logps": padded(c, old)}
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs)


def rejection(**kw) -> types.SimpleNamespace:
    """AReaL's ``RejectionSamplingConfig`` fields (token level, ratio metric, mask action by default)."""
    return types.SimpleNamespace(**{"level": "token", "action": "mask", "metric": "ratio", "agg": "mean",
                                    "lower": None, **kw})


def test_decoupled_matches_areal_and_verl(verl, areal):
    # AReaL: its cap w > c → 0 is rejection sampling at token level on the ratio, mask action; verl:
    # the rollout-correction weights with the bounds [1e-30, c], which keep the response mask.
    core, helper = verl
    functional, _ = areal

    def compare(c, tol):
        eps, eps_high, cap = 0.2, 0.28, 1.5
        ours, _ = decoupled_ppo_loss(c.theta, c.prox, c.behav, c.adv, c.mask, eps, eps_high, cap)
        assert_same(ours, areal_loss(functional, c, c.prox, eps, eps_high, rejection(upper=cap)), c.theta,
                    max(tol, AREAL_W_TOL, key=lambda t: t["rtol"]))
        if not verl_weighs(c, 1e-30, cap):
            return
        ours, _ = decoupled_ppo_loss(c.theta, c.prox, c.behav, c.adv, c.mask, eps, eps_high, cap)
        w = verl_weights(helper, c, "token", f"1e-30_{cap}")
        assert_same(ours, verl_vanilla(core, c, c.prox, eps, eps_high, w), c.theta, tol)

    each_case(compare)


def test_naive_matches_areal_and_verl(verl, areal):
    # π_prox = π_behav: AReaL's loss without rejection sampling, verl's vanilla PPO without weights.
    core, _ = verl
    functional, _ = areal

    def compare(c, tol):
        ours, _ = naive_ppo_loss(c.theta, c.behav, c.adv, c.mask, 0.2, 0.28)
        assert_same(ours, areal_loss(functional, c, c.behav, 0.2, 0.28), c.theta, tol)
        ours, _ = naive_ppo_loss(c.theta, c.behav, c.adv, c.mask, 0.2, 0.28)
        assert_same(ours, verl_vanilla(core, c, c.behav, 0.2, 0.28), c.theta, tol)

    each_case(compare)


def test_naive_and_gspo_match_trl_grpo(trl):
    # TRL's GRPO loss (bnpo: token mean over the batch) on the rollout's log-probs, its "token"
    # importance-sampling level = naive PPO; its "sequence" level = GSPO, where it is the same loss
    # as GSPO-token (advantages constant within a sequence, w = 1). Its behaviour weights (vLLM
    # importance sampling) are computed inside generation, not by a callable: not compared.
    def compare(c, tol):
        ours, _ = naive_ppo_loss(c.theta, c.behav, c.adv, c.mask, 0.2, 0.28)
        assert_same(ours, trl_loss(trl, c, c.behav, 0.2, 0.28, "token"), c.theta, tol)

    def compare_gspo(c, tol):
        ours, _ = gspo_loss(c.theta, c.prox, c.prox, c.adv, c.mask, c.cu_seqlens, 0.02, 0.03)
        assert_same(ours, trl_loss(trl, c, c.prox, 0.02, 0.03, "sequence"), c.theta, tol)

    each_case(compare)
    each_case(compare_gspo, seq_constant_adv=True)


def test_tis_matches_verl_token_is_and_areal_clamp(verl, areal):
    # verl's decoupled token-level IS (rollout_is="token", threshold C); AReaL's clamp action.
    core, helper = verl
    functional, _ = areal

    def compare(c, tol):
        cap = 2.0
        ours, _ = tis_loss(c.theta, c.prox, c.behav, c.adv, c.mask, 0.2, None, cap)
        assert_same(ours, verl_vanilla(core, c, c.prox, 0.2, 0.2, verl_weights(helper, c, "token", cap)), c.theta, tol)
        ours, _ = tis_loss(c.theta, c.prox, c.behav, c.adv, c.mask, 0.2, None, cap)
        assert_same(ours, areal_loss(functional, c, c.prox, 0.2, None, rejection(action="clamp", upper=cap)),
                    c.theta, max(tol, AREAL_W_TOL, key=lambda t: t["rtol"]))

    each_case(compare)


def test_mis_matches_verl_sequence_is_with_rejection(verl):
    # verl's decoupled_seq_is_rs preset: sequence IS weights (threshold = high) and rejection of
    # the sequences with -Σ log w outside [log low, log high] (seq_sum_k1; the same sequences as
    # ours when low · high = 1). verl drops them from its mask; the denominator stays Σ loss mask.
    core, helper = verl
    bounds = ((0.5, 2.0), (0.8, 1.25))

    def compare(c, tol):
        low, high = bounds[int(c.mask.sum()) % 2]
        ours, _ = mis_loss(c.theta, c.prox, c.behav, c.adv, c.mask, c.cu_seqlens, 0.2, None, low, high)
        m = padded(c, c.mask.to(c.theta.dtype))
        kept, _ = helper.compute_rollout_rejection_mask(padded(c, c.prox - c.behav), m, "seq_sum_k1", f"{low}_{high}")
        w = verl_weights(helper, c, "sequence", high)
        assert_same(ours, verl_vanilla(core, c, c.prox, 0.2, 0.2, w, mask=kept), c.theta, tol)

    each_case(compare)


def test_icepop_matches_verl_and_areal(verl, areal):
    # verl's decoupled_token_icepop ("α_β" threshold: weights outside [α, β] zeroed, mask kept);
    # AReaL's token-level ratio rejection with lower α and upper β.
    core, helper = verl
    functional, _ = areal

    def compare(c, tol):
        low, high = 0.5, 5.0
        if verl_weighs(c, low, high):
            ours, _ = icepop_loss(c.theta, c.prox, c.behav, c.adv, c.mask, 0.2, None, low, high)
            w = verl_weights(helper, c, "token", f"{low}_{high}")
            assert_same(ours, verl_vanilla(core, c, c.prox, 0.2, 0.2, w), c.theta, tol)
        ours, _ = icepop_loss(c.theta, c.prox, c.behav, c.adv, c.mask, 0.2, None, low, high)
        assert_same(ours, areal_loss(functional, c, c.prox, 0.2, None, rejection(lower=low, upper=high)),
                    c.theta, max(tol, AREAL_W_TOL, key=lambda t: t["rtol"]))

    each_case(compare)


def test_m2po_matches_areal(areal):
    # verl 0.9.1 and TRL 1.16.0 ship no M2PO; AReaL's PPO actor does (m2_threshold): its mask on
    # the loss mask, then its loss without rejection sampling. AReaL divides by the tokens kept,
    # we by all loss tokens (masked ones stay in the denominator), hence the factor kept / all.
    functional, actor = areal
    masked = 0

    def compare(c, tol):
        nonlocal masked
        tau = 0.04
        theirs_mask = actor._apply_m2po_masking(c.behav, c.prox, c.mask, tau)
        ours, stats = m2po_loss(c.theta, c.prox, c.behav, c.adv, c.mask, 0.2, None, tau)
        assert stats["m2po_masked_ratio"].item() * c.mask.sum().item() == pytest.approx(
            (c.mask & ~theirs_mask).sum().item())
        masked += int((c.mask & ~theirs_mask).sum())
        scale = theirs_mask.sum().item() / c.mask.sum().item()
        assert_same(ours, areal_loss(functional, c, c.prox, 0.2, None, mask=theirs_mask), c.theta, tol, scale)

    each_case(compare)
    assert masked > 0  # the cases reach the mask


def test_gspo_matches_verl_and_areal(verl, areal):
    # verl's compute_policy_loss_gspo (GSPO-token, token-mean) with decoupled PPO's weights (as in
    # test_decoupled_...); AReaL's sequence-level ratio where it is the same loss: advantages
    # constant within a sequence and w = 1 (π_behav = π_prox; AReaL averages a sequence's
    # weighted terms before the gradient reaches its tokens, GSPO-token does not).
    core, helper = verl
    functional, _ = areal
    clips = ((3e-4, 4e-4), (0.02, 0.03), (0.2, 0.2))

    def compare(c, tol):
        eps, eps_high = clips[int(c.mask.sum()) % 3]
        if not verl_weighs(c, 1e-30, 5.0):
            return
        ours, _ = gspo_loss(c.theta, c.prox, c.behav, c.adv, c.mask, c.cu_seqlens, eps, eps_high, 5.0)
        w = verl_weights(helper, c, "token", "1e-30_5.0")
        m = padded(c, c.mask.to(c.theta.dtype))
        theirs, _ = core.compute_policy_loss_gspo(padded(c, c.prox), padded(c, c.theta), padded(c, c.adv), m,
                                                  "token-mean", verl_config(core, eps, eps_high, c), w)
        assert_same(ours, theirs, c.theta, tol)

    def compare_areal(c, tol):
        eps, eps_high = clips[int(c.mask.sum()) % 3]
        ours, _ = gspo_loss(c.theta, c.prox, c.prox, c.adv, c.mask, c.cu_seqlens, eps, eps_high, 5.0)
        assert_same(ours, areal_loss(functional, c, c.prox, eps, eps_high, level="sequence"), c.theta, tol)

    each_case(compare)
    each_case(compare_areal, seq_constant_adv=True)
