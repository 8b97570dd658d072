"""The trainer's Triton packed attention (``trainer/triton_packed_attention.py``) against a per-sequence
fp32 ``sdpa`` reference: output and gradients, grouped-query heads, sequences of one token and
sequences across block edges; on CPU through Triton's interpreter (``conftest``), on CUDA as is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from areal_async.trainer import triton_packed_attention  # noqa: E402
from areal_async.trainer.triton_packed_attention import block_table, varlen_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["loaded bounds", "fixed bound"])
def loops(request, monkeypatch):
    """Both loop forms of the kernels: ending at loaded bounds (the GPU's, with the unmasked blocks
    below the diagonal) and the interpreter's fixed bound under full masks."""
    if request.param == "fixed bound":
        if not triton_packed_attention._INTERPRET:
            pytest.skip("the fixed-bound loops exist for Triton's interpreter")
    else:
        monkeypatch.setattr(triton_packed_attention, "_INTERPRET", False)
    return request.param


def reference(q, k, v, lengths, scale):
    """Causal attention per sequence in fp32 with K/V heads repeated: ``[T, H, D]``."""
    group = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lengths:
        qs, ks, vs = (t[s : s + n].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, scale=scale)[0]
                    .transpose(0, 1))
        s += n
    return torch.cat(outs)


def inputs(lengths, heads=4, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


@pytest.mark.parametrize("lengths", [[5], [1, 130, 64, 3], [200, 1, 70], [128, 129, 256, 63]])
def test_matches_per_sequence_reference_with_gradients(lengths, loops):
    # fp32 inputs: the interpreter's products are exact fp32 (on CUDA they are TF32), so the bound
    # is tight on CPU; a wrong mask or a wrong softmax statistic gives O(1) errors
    q, k, v, cu = inputs(lengths)
    scale = 0.3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, max(lengths), scale)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, lengths, scale)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_grouped_query_heads_read_their_own_kv_head(heads, kv_heads):
    # query head h reads K/V head h // (H / Hkv); a wrong mapping gives O(1) errors
    lengths = [40, 90]
    q, k, v, cu = inputs(lengths, heads, kv_heads, seed=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, 90)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, lengths, 16**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name


def test_a_sequence_gets_the_same_bits_whatever_it_is_packed_with(loops):
    # blocks are aligned to each sequence's start and every sum runs in a fixed order, so the
    # last sequence's output and gradients are bitwise those of the sequence alone
    lengths = [70, 1, 150]
    q, k, v, cu = inputs(lengths, seed=1)
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, 150)
    grads = torch.autograd.grad(out, leaves, grad_out)
    s = 71
    alone_leaves = [t[s:].clone().requires_grad_() for t in (q, k, v)]
    alone_cu = torch.tensor([0, 150], dtype=torch.int32, device=DEVICE)
    alone = varlen_attention(*alone_leaves, alone_cu, 150)
    alone_grads = torch.autograd.grad(alone, alone_leaves, grad_out[s:])
    assert torch.equal(out[s:], alone)
    for a, b in zip(grads, alone_grads):
        assert torch.equal(a[s:], b)


def test_block_table_covers_every_block_once_in_work_order():
    cu = torch.tensor([0, 5, 6, 300, 301], dtype=torch.int32)
    seq, first = block_table(cu, 301, 128, True)
    assert seq.numel() == 301 // 128 + 4
    valid = seq >= 0
    got = sorted(zip(seq[valid].tolist(), first[valid].tolist()))
    assert got == [(0, 0), (1, 0), (2, 0), (2, 128), (2, 256), (3, 0)]
    assert not valid[valid.sum():].any()  # surplus programs come last
    assert first[valid].tolist() == sorted(first[valid].tolist(), reverse=True)  # longest work first
    _, key_first = block_table(cu, 301, 128, False)
    assert key_first[valid].tolist() == sorted(key_first[valid].tolist())


def test_bad_shapes_name_the_problem():
    q, k, v, cu = inputs([8])
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        varlen_attention(q[:, :3], k, v, cu, 8)
    with pytest.raises(ValueError, match="head_dim 12"):
        varlen_attention(q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(), cu, 8)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), 8)
