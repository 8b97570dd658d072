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
