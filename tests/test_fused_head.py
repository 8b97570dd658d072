"""The fused LM head + log-softmax (``trainer/packed_policy.py``) against the checkpointed head.

Both paths compute each chunk's logits with the same ``F.linear`` call on the same rows, so in
fp32 they differ only in how the log-softmax and its gradient are evaluated:

- ``logp = z_y − lse`` (``torch.logsumexp``) vs ``log_softmax(z)[y]``: a few ulp of |logp|, which
  reaches 18 with the peaked logits below (ulp 1.9e-6; measured 1.9e-6) → 5e-6 absolute.
- entropy ``−Σ p·x`` with ``x = z − lse`` in both, ``p`` rounded differently by ~1 ulp per term:
  ≤ 1e-6 relative on a value ≈ 6–7 nats → 1e-5 absolute.
- the logits' gradient ``g·(onehot − p)/τ`` is formed directly here and by autograd through
  ``log_softmax``'s backward (``g·onehot − exp(logp)·g``, then ``/τ``) there: per-element
  relative differences ~1e-7; ``grad_h = grad_z W`` and ``grad_W = grad_zᵀ h`` sum V or C such
  terms, so with |grad| = O(1) the difference is ~1e-6 → ``rtol = atol = 1e-5``.

A wrong sign, a missing 1/τ or a gradient taken with respect to the scaled logits is a relative
error ≥ |1 − τ| = 0.3 at τ = 0.7 (or 100 %), far above these tolerances.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from areal_async.batch_invariant import make_linears_batch_invariant
from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.packed_policy import _EAGER_KERNELS, PackedPolicy, _FusedHeadLogp, _fusable, _head_logp
from areal_async.trainer.packing import pack_sequences

torch.set_num_threads(1)

SEQS = [[3, 17, 42, 9, 11, 250, 7], [5, 6], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 1], [77]]


def _checkpointed(head, h, y, temperature, chunk):
    parts = [checkpoint(_head_logp, head, h[s : s + chunk], y[s : s + chunk], temperature, use_reentrant=False)
             for s in range(0, h.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_matches_checkpointed_head_fp32(temperature):
    torch.manual_seed(0)
    t, hidden, vocab, chunk = 37, 64, 1000, 8  # 37 = 4 full chunks + a partial one
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.mul_(3.0)  # logits of O(1–10): a peaked softmax, not a uniform one
    h = torch.randn(t, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (t,))
    g = torch.randn(t)  # a loss with weights of both signs per token

    lp, ent = _FusedHeadLogp.apply(h, head.weight, y, temperature, chunk, torch.float32, _EAGER_KERNELS)
    grads = torch.autograd.grad((lp * g).sum(), (h, head.weight))
    ref_lp, ref_ent = _checkpointed(head, h, y, temperature, chunk)
    ref_grads = torch.autograd.grad((ref_lp * g).sum(), (h, head.weight))

    assert lp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=5e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert want.abs().max() > 0.1  # the comparison is not between near-zero gradients


def test_fused_head_gradcheck_float64():
    # Finite differences in float64 (the kernels compute in fp64 for fp64 inputs): the hand-written
    # backward is the derivative of the forward, at τ ≠ 1 and with a partial last chunk.
    torch.manual_seed(0)
    h = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    w = (2 * torch.randn(50, 16, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, 50, (9,))

    def logp(h, w):
        return _FusedHeadLogp.apply(h, w, y, 0.7, 4, torch.float64, _EAGER_KERNELS)[0]

    assert torch.autograd.gradcheck(logp, (h, w))


def _policy(path, **kw) -> PackedPolicy:
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_packed_attention(lm)
    return PackedPolicy(lm, **kw)


def _logp_and_grads(policy, temperature, chunk):
    policy.zero_grad(set_to_none=True)
    lp, ent = policy(pack_sequences(SEQS), temperature, chunk)
    (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in policy.named_parameters()}


def test_packed_policy_fused_head_matches_checkpointed(tiny_qwen3_dir):
    policy = _policy(tiny_qwen3_dir)
    assert _fusable(policy.lm.lm_head)
    for temperature in (1.0, 0.7):
        policy.fused_head = True
        lp, ent, grads = _logp_and_grads(policy, temperature, 5)
        policy.fused_head = False
        ref_lp, ref_ent, ref_grads = _logp_and_grads(policy, temperature, 5)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=5e-6)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in grads:  # the tied embedding / LM head and every layer's weights
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    # With gradients disabled (the proximal-policy pass) the fused path gives the same values.
    with torch.no_grad():
        policy.fused_head = True
        lp_ng, _ = policy(pack_sequences(SEQS), 0.7, 5)
    torch.testing.assert_close(lp_ng, lp, rtol=0, atol=0)


def test_fused_head_under_bf16_autocast(tiny_qwen3_dir):
    # The compute dtype comes from autocast: bf16 logits, fp32 log-softmax; weights stay fp32.
    policy = _policy(tiny_qwen3_dir, autocast_dtype=torch.bfloat16)
    policy.fused_head = True
    lp, ent, grads = _logp_and_grads(policy, 0.7, 5)
    policy.fused_head = False
    ref_lp, ref_ent, ref_grads = _logp_and_grads(policy, 0.7, 5)
    assert lp.dtype == torch.float32 and grads["lm.model.embed_tokens.weight"].dtype == torch.float32
    # Same bf16 logits in both; the fp32 reductions differ by ulps, the bf16 gradient GEMMs'
    # accumulation (one chunk at a time into a bf16 buffer vs autograd's sum) by ~2^-8 relative
    # (measured 2.9e-3 of max |g|).
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=5e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    g, ref = grads["lm.model.embed_tokens.weight"], ref_grads["lm.model.embed_tokens.weight"]
    assert float((g - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


def test_tiled_head_keeps_checkpointed_path(tiny_model_dir):
    # Deterministic mode replaces the head's forward with tiled GEMMs: the fused path must not
    # bypass them, so the policy falls back to the checkpointed head (bitwise equal to forcing it).
    policy = _policy(tiny_model_dir)
    make_linears_batch_invariant(policy.lm)
    assert not _fusable(policy.lm.lm_head)
    with torch.no_grad():
        auto = policy(pack_sequences(SEQS), 0.7, 5)
        policy.fused_head = False
        forced = policy(pack_sequences(SEQS), 0.7, 5)
    assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1])
