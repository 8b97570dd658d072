"""The engine's Triton kernels against the PyTorch path they replace.

On a machine without a GPU they run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py``); on CUDA (marker ``gpu``) compiled. Skipped where Triton is not installed.
fp32 throughout, so the fused kernels (fp32 inside, one rounding) and the module path (fp32
modules) agree to float rounding: tolerances are a few ulps of the magnitudes involved.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_async.embedded.engine.kv_cache import KVCache

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 17, 42, 9, 11, 120, 7] * 3, [3, 4], list(range(30, 70))]


def _forward_pair(model_dir, device):
    """Two ``BatchedForward``s over one model: the PyTorch module path and the fused-kernel path."""
    from transformers import AutoModelForCausalLM

    from areal_async.embedded.engine.forward import BatchedForward

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    plain, fused = BatchedForward(model, 8, 128, cuda_graph=False), BatchedForward(model, 8, 128, cuda_graph=False)
    for fwd, on in ((plain, False), (fused, True)):
        fwd.kernels = dataclasses.replace(fwd.kernels, decode_attention="triton" if on else "matmul", fused_layers=on)
        fwd.cache = KVCache(len(fwd.layers), 8, fwd.num_kv_heads, 128, fwd.head_dim, fwd.dtype, fwd.device,
                            keys_transposed=not on)
    return plain, fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_layer_kernels_match_the_module_path(tiny_model_dir, tiny_qwen3_dir, arch, device):
    # Prefill of 3 prompts, then 4 greedy decode steps: the fused path (add+RMSNorm, q/k norm +
    # RoPE + cache store, SiLU·up, decode attention) must give the module path's logits. Decode
    # reads the keys/values the fused kernels stored, so a wrong cache place fails here too.
    plain, fused = _forward_pair(tiny_qwen3_dir if arch == "qwen3" else tiny_model_dir, device)
    slots = [0, 1, 2]
    a, b = plain.prefill(PROMPTS, slots), fused.prefill(PROMPTS, slots)
    assert (a - b).abs().max().item() < 2e-5
    tokens, positions = a.argmax(-1).tolist(), [len(p) for p in PROMPTS]
    for _ in range(4):
        ids = torch.tensor(tokens, device=device)
        a, b = plain.decode_batch(ids, positions), fused.decode_batch(ids, positions)
        assert (a - b).abs().max().item() < 2e-5
        tokens, positions = a.argmax(-1).tolist(), [p + 1 for p in positions]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_sample_matches_the_torch_sampler(device):
    from areal_async.embedded.engine.noise_hash import gumbel_from_keys, noise_keys
    from areal_async.embedded.engine.triton_sampling import fused_sample

    torch.manual_seed(0)
    rows, vocab = 6, 5000  # 3 pieces of 2,048, the last one partial
    logits = (torch.randn(rows, vocab) * 3).to(device)
    logits[2, 3000:] = float("-inf")  # whole pieces of -inf must not poison the log-sum-exp
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0], device=device)
    keys = noise_keys(list(range(rows)), [7 * i for i in range(rows)], device)
    tokens, logprobs = fused_sample(logits, temperature, keys)
    z = logits / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    ref_logp = torch.log_softmax(z, -1)
    ref = torch.where(temperature > 0, torch.argmax(ref_logp + gumbel_from_keys(keys, vocab), -1),
                      torch.argmax(logits, -1))
    assert torch.equal(tokens, ref)
    assert int(tokens[2]) < 3000
    assert (logprobs - ref_logp.gather(-1, ref[:, None])[:, 0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_matches_softmax_attention(device):
    from areal_async.embedded.engine.triton_decode_attention import decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length = 5, 4, 2, 32, 150
    q = torch.randn(batch, heads, dim, device=device)
    keys = torch.randn(batch + 1, kv_heads, length, dim, device=device)
    values = torch.randn(batch + 1, kv_heads, length, dim, device=device)
    positions = torch.tensor([0, 1, 63, 64, 149], device=device)  # block edges of BLOCK_N = 64
    out = decode_attention(q, keys, values, positions, dim**-0.5)
    groups = heads // kv_heads
    for b, p in enumerate(positions.tolist()):
        qb = q[b].view(kv_heads, groups, dim)
        probs = torch.softmax(qb @ keys[b, :, : p + 1].transpose(-1, -2) * dim**-0.5, dim=-1)
        ref = (probs @ values[b, :, : p + 1]).reshape(heads, dim)
        assert torch.allclose(out[b], ref, atol=1e-5, rtol=1e-5), (b, (out[b] - ref).abs().max())
