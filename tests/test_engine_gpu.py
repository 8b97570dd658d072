"""The embedded engine on CUDA (marker ``gpu``, deselected by default): greedy tokens and log-probs
against HF's own forward on the same weights, in fp32 and bf16, with and without prompt reuse."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 11, 120, 7] * 3, [3, 4], list(range(30, 70)), [77] * 5]


async def _generate(engine, params: SamplingParams):
    task = asyncio.create_task(engine.run())
    try:
        return await asyncio.gather(*(engine.generate(p, params, f"r{i}") for i, p in enumerate(PROMPTS)))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _check_against_hf(model, prompts, outs, new_tokens: int, tol: float) -> None:
    """HF's forward on prompt + output (teacher forcing): each engine token must be HF's argmax
    unless HF's top-2 margin is within ``tol`` (a near-tie that rounding may break either way),
    and the log-probs must agree within ``tol``."""
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.output_ids) == new_tokens
        ids = torch.tensor([prompt + out.output_ids], device="cuda")
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(out.output_ids, device="cuda")
        margin = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
        assert bool((margin <= tol).all()), f"engine token not HF's argmax: margins {margin.tolist()}"
        ref = torch.log_softmax(logits, -1).gather(-1, chosen[:, None])[:, 0]
        diff = (torch.tensor(out.logprobs, device="cuda") - ref).abs().max().item()
        assert diff <= tol, f"log-prob differs from HF by {diff}"


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_engine_matches_hf_forward_on_cuda(tiny_qwen3_dir, dtype, tol):
    # Greedy output of the batched engine against HF's forward on the same weights.
    engine, _ = load_engine(str(tiny_qwen3_dir), dtype, "cuda", max_running_requests=8, max_seq_len=128)
    outs = asyncio.run(_generate(engine, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)))
    _check_against_hf(engine.forward.model, PROMPTS, outs, 24, tol)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_prompt_reuse_on_cuda_matches_hf_forward(tiny_qwen3_dir, dtype, tol):
    # Prompts sharing a 40-token preamble, each sent twice, in two waves: twins in one step, a
    # second prefill forward reading a prefix the first stored, then prefixes cached by an earlier
    # step (the fused layers' cache store and the prefix attention over cached keys and values).
    preamble = list(range(100, 140))
    prompts = [preamble + q for q in ([5, 17, 42], [99, 7, 250, 11], [8, 9], [77, 21, 30])] * 2
    engine, _ = load_engine(str(tiny_qwen3_dir), dtype, "cuda", max_running_requests=16, max_seq_len=128)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    async def main():
        task = asyncio.create_task(engine.run())
        try:
            outs = []
            for wave in (prompts, prompts):
                outs += await asyncio.gather(*(engine.generate(p, greedy, f"w{len(outs)}-{i}")
                                               for i, p in enumerate(wave)))
            return outs
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    outs = asyncio.run(main())
    assert sum(o.cached_tokens for o in outs) >= 12 * len(preamble)
    _check_against_hf(engine.forward.model, prompts * 2, outs, 16, tol)


def test_cuda_graph_decode_matches_eager_decode(tiny_qwen3_dir):
    # Same weights, same requests: replayed graphs (padded rows, attention span rounded up to a
    # multiple of 128) against eager decode steps (exact rows and span), fp32.
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    runs = []
    for cuda_graph in (True, False):
        engine, _ = load_engine(str(tiny_qwen3_dir), "float32", "cuda", max_running_requests=8, max_seq_len=256,
                                cuda_graph=cuda_graph)
        assert (engine.forward.graphs is not None) == cuda_graph
        runs.append(asyncio.run(_generate(engine, greedy)))
        if cuda_graph:
            assert engine.forward.graphs.graphs, "no graph was captured"
    for graphed, eager in zip(*runs):
        assert graphed.output_ids == eager.output_ids
        assert max(abs(a - b) for a, b in zip(graphed.logprobs, eager.logprobs)) < 1e-4


def test_fused_gumbel_argmax_matches_the_torch_path():
    from areal_async.embedded.engine.noise_hash import gumbel_from_keys, noise_keys
    from areal_async.embedded.engine.triton_sampling import fused_gumbel_argmax

    torch.manual_seed(0)
    z = torch.log_softmax(torch.randn(64, 151936, device="cuda") * 2, -1)
    z[3, 100:] = float("-inf")  # a filtered row draws only among its finite entries
    keys = noise_keys(list(range(64)), [7 * i for i in range(64)], "cuda")
    fused = fused_gumbel_argmax(z, keys)
    assert fused is not None, "Triton is not available"
    reference = torch.argmax(z + gumbel_from_keys(keys, z.shape[1]), dim=-1)
    assert torch.equal(fused, reference)
    assert int(fused[3]) < 100


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_decode_attention_matches_softmax_attention(dtype, tol):
    from areal_async.embedded.engine.triton_decode_attention import decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length = 9, 16, 8, 128, 300
    q = torch.randn(batch, heads, dim, device="cuda").to(dtype)
    keys = torch.randn(batch + 1, kv_heads, length, dim, device="cuda").to(dtype)
    values = torch.randn(batch + 1, kv_heads, length, dim, device="cuda").to(dtype)
    positions = torch.tensor([0, 1, 31, 32, 33, 100, 255, 298, 299], device="cuda")
    out = decode_attention(q, keys, values, positions, dim**-0.5)
    assert out is not None, "Triton is not available"
    groups = heads // kv_heads
    for b, p in enumerate(positions.tolist()):
        qb = q[b].float().view(kv_heads, groups, dim)
        probs = torch.softmax(qb @ keys[b, :, : p + 1].float().transpose(-1, -2) * dim**-0.5, dim=-1)
        ref = (probs @ values[b, :, : p + 1].float()).reshape(heads, dim)
        assert torch.allclose(out[b].float(), ref, atol=tol, rtol=tol), (b, (out[b].float() - ref).abs().max())
    # every block configuration visits the same positions: results agree to rounding
    for config in ((32, 4, 2), (128, 8, 1)):  # fp32 blocks of 128 rows fit shared memory in one stage
        other = decode_attention(q, keys, values, positions, dim**-0.5, config)
        assert torch.allclose(other.float(), out.float(), atol=tol, rtol=tol), config
