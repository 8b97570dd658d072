"""CUDA path of the packed attention: ``varlen_attn`` in bf16 (marker ``gpu``, deselected by default)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.trainer.attention import packed_kwargs, use_packed_attention
from areal_async.trainer.logprobs import PackedPolicy, packed_logprobs
from areal_async.trainer.packing import pack_sequences

pytestmark = pytest.mark.gpu

SEQS = [[3, 17, 42, 9, 11, 250, 7] * 9, [5, 6], [100 + i for i in range(40)], [77]]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_varlen_packed_matches_alone_and_sdpa(fixture, request):
    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    use_packed_attention(model)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    packed = pack_sequences(SEQS).to("cuda")
    bounds = packed.cu_seqlens.tolist()
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None],
                       **packed_kwargs(packed.cu_seqlens, packed.max_seqlen)).logits[0].float()
        for b, seq in enumerate(SEQS):
            one = pack_sequences([seq]).to("cuda")
            alone = model(input_ids=one.input_ids[None], position_ids=one.position_ids[None],
                          **packed_kwargs(one.cu_seqlens, one.max_seqlen)).logits[0].float()
            diff = (logits[bounds[b]:bounds[b + 1]] - alone).abs().max().item()
            hf = reference(input_ids=torch.tensor([seq], device="cuda")).logits[0].float()
            print(f"{fixture} seq {b} (len {len(seq)}): packed vs alone {diff:.3g}, vs sdpa "
                  f"{(alone - hf).abs().max().item():.3g}")
            assert diff <= 2e-2, diff  # bf16 logits of a tiny random model are O(1)
            torch.testing.assert_close(alone, hf, rtol=3e-2, atol=3e-2)


def test_varlen_logprobs_backward(tiny_qwen3_dir, monkeypatch):
    import torch.nn.attention.varlen as varlen

    calls = []
    real = varlen.varlen_attn
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).cuda()
    use_packed_attention(model)
    policy = PackedPolicy(model)
    packed = pack_sequences(SEQS).to("cuda")
    logp, entropy = packed_logprobs(policy, packed, temperature=0.8, chunk_tokens=16)
    logp.sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert torch.isfinite(entropy).all()
    assert len(calls) == model.config.num_hidden_layers  # one call per layer (forward; backward is autograd)


def test_varlen_native_gqa_matches_repeated_kv(monkeypatch):
    # K/V with H_kv heads go to the flash kernel as they are (no repeat), and the result and the
    # gradients equal those of K/V repeated to H heads: the kernel reads K/V head h // (H / H_kv)
    # for query head h, the same numbers the repeat copies there; its backward sums the group's
    # dK/dV as the repeat's backward does. bf16 outputs O(1): measured differences are printed,
    # the bound is a few bf16 ulps.
    import torch.nn.attention.varlen as varlen

    from areal_async.trainer.attention import packed_attention

    kv_heads_seen = []
    real = varlen.varlen_attn

    def spy(q, k, *args, **kwargs):
        kv_heads_seen.append(k.shape[1])
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", spy)
    torch.manual_seed(0)
    cu = torch.tensor([0, 300, 301, 1000, 1700], dtype=torch.int32, device="cuda")
    n, kw = 1700, {"cu_seq_lens_q": cu, "max_length_q": 700}
    q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (16, 8, 8))
    grad_out = torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for native in (True, False):
        out, _ = packed_attention(torch.nn.Module(), q, k, v, None, 128**-0.5, native_gqa=native, **kw)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    assert kv_heads_seen == [8, 16]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        diff = float((a.float() - b.float()).abs().max())
        print(f"native GQA vs repeat: {name} max |Δ| {diff:.3g} (max |x| {float(b.float().abs().max()):.3g})")
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)



def test_triton_backend_matches_flash_in_the_model(tiny_qwen3_dir):
    # trainer.attention_backend: triton against the flash kernel, through a whole (tiny) model:
    # log-probs and a gradient agree to bf16 rounding, and the Triton kernels really ran
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).cuda()
    policy = PackedPolicy(model)
    packed = pack_sequences(SEQS).to("cuda")
    results = []
    for backend in ("flash", "triton"):
        use_packed_attention(model, backend=backend)
        model.zero_grad(set_to_none=True)
        logp, _ = packed_logprobs(policy, packed, temperature=1.0, chunk_tokens=32)
        logp.sum().backward()
        results.append((logp.detach().float(), model.model.layers[0].self_attn.k_proj.weight.grad.float().clone()))
    assert model.config._attn_implementation == "packed_triton"
    (logp_f, grad_f), (logp_t, grad_t) = results
    print(f"triton vs flash: max |Δ logp| {float((logp_t - logp_f).abs().max()):.3g}, "
          f"||Δ grad|| / ||grad|| {float((grad_t - grad_f).norm() / grad_f.norm()):.3g}")
    torch.testing.assert_close(logp_t, logp_f, rtol=0, atol=5e-2)
    assert float((grad_t - grad_f).norm() / grad_f.norm()) < 2e-2


def _forest_seqs(seed: int = 0, n_prompts: int = 3) -> tuple[list[list[int]], torch.Tensor]:
    """A quickstart-like forest over several 128-node blocks: a 150-token preamble shared by
    ``n_prompts`` prompts, 4 responses each (one empty, one a prefix of another), and one unrelated sequence;
    plus the loss positions (the response-predicting ones)."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, 380, (n,), generator=g).tolist()  # noqa: E731
    pre = tok(150)
    seqs, head, start = [], [], 0
    for p in range(n_prompts):
        prompt = pre + tok(20 + 10 * p)
        responses = [tok(60 + 30 * r) for r in range(4)]
        responses[1] = []
        responses[3] = responses[2][:25]
        for r in responses:
            seqs.append(prompt + r)
            head += list(range(start + len(prompt) - 1, start + len(prompt) - 1 + len(r)))
            start += len(prompt) + len(r)
    seqs.append(tok(90))
    head += list(range(start + 10, start + 89))
    return seqs, torch.tensor(head)


@pytest.mark.parametrize("n_prompts", [3, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_packing_matches_unshared_on_cuda(tiny_qwen3_dir, dtype, n_prompts, monkeypatch):
    # bf16: FlexAttention under the forest's block mask (the CUDA tree path) against varlen_attn
    # on the unshared packing; both compared with the fp32 unshared result, the tree's error may
    # be no larger than about the unshared bf16 error. fp32: the per-tree sdpa path, tight. Two
    # forest sizes: the second runs the compiled flex kernel at a new node count (dynamic shapes;
    # on the CPU, inductor's C++ flex template failed to build for the second size, torch 2.13).
    from areal_async.trainer import attention
    from areal_async.trainer.tree import pack_tree

    flex_calls = []
    real_flex = attention._flex_tree
    monkeypatch.setattr(attention, "_flex_tree", lambda *a: flex_calls.append(1) or real_flex(*a))
    seqs, head = _forest_seqs(n_prompts=n_prompts)
    results = {}
    for name, dt, pack in (("ref", torch.float32, pack_sequences), ("flat", dtype, pack_sequences),
                           ("tree", dtype, pack_tree)):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=dt).cuda()
        use_packed_attention(model)
        policy = PackedPolicy(model)
        batch = pack(seqs, head).to("cuda")
        logp, _ = packed_logprobs(policy, batch, temperature=1.0, chunk_tokens=64)
        weight = torch.linspace(-1, 1, logp.numel(), device="cuda")
        (logp.float() * weight).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results[name] = (logp.detach().float(), grads, batch.num_tokens)
    assert results["tree"][2] < results["flat"][2]
    (ref_lp, ref_g, _), (flat_lp, flat_g, _), (tree_lp, tree_g, _) = results["ref"], results["flat"], results["tree"]
    flat_err, tree_err = (flat_lp - ref_lp).abs().max().item(), (tree_lp - ref_lp).abs().max().item()
    flat_gerr = ((flat_g - ref_g).norm() / ref_g.norm()).item()
    tree_gerr = ((tree_g - ref_g).norm() / ref_g.norm()).item()
    print(f"{dtype}: log-prob error flat {flat_err:.3g} tree {tree_err:.3g}; gradient rel. error flat "
          f"{flat_gerr:.3g} tree {tree_gerr:.3g}; flex calls {len(flex_calls)}")
    if dtype == torch.float32:
        assert not flex_calls
        torch.testing.assert_close(tree_lp, ref_lp, rtol=0, atol=1e-5)
        assert tree_gerr < 1e-5
    else:
        assert len(flex_calls) == 2  # once per layer of the tree's forward (the flat one runs varlen_attn)
        assert tree_err <= 2 * flat_err + 1e-2 and tree_gerr <= 2 * flat_gerr + 1e-2
