"""Batch invariance in deterministic mode: fixed-tile GEMMs, the embedded engine, the trainer.

The engine test runs one request alone, next to 3 others and next to 33 others (different prompt
lengths, seeds and lengths, so they finish and get compacted at different steps) and requires
bitwise-identical tokens and log-probs with ``batch_invariant=True``. For the throughput forward
it prints the max abs log-prob difference (a measurement, not an assertion).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from areal_async.batch_invariant import CUDA_ROW_TILE, ROW_TILE, make_linears_batch_invariant, tiled_linear
from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_row_result_ignores_other_rows(dtype, device):
    torch.manual_seed(0)
    tile = ROW_TILE if device == "cpu" else CUDA_ROW_TILE
    k = 64 if device == "cpu" else 1024
    w, b = torch.randn(384, k).to(dtype).to(device), torch.randn(384).to(dtype).to(device)
    row = torch.randn(1, k).to(dtype).to(device)
    ref = tiled_linear(row, w, b)
    for m, pos in [(4, 2), (tile, tile - 1), (34, 17), (100, 99), (3 * tile + 5, 2 * tile + 3)]:
        x = torch.randn(m, k).to(dtype).to(device)
        x[pos] = row[0]
        assert torch.equal(tiled_linear(x, w, b)[pos], ref[0]), (m, pos)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5 if device == "cpu" else 1e-3  # K = 1024 sums on CUDA
    assert torch.allclose(tiled_linear(x, w, b), F.linear(x, w, b), rtol=tol, atol=tol)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run_engine(model_dir, deterministic: bool, n_others: int, dtype: str = "float32", device: str = "cpu",
                fixed_shape: bool = False) -> tuple[list[int], list[float]]:
    """Tokens and log-probs of the target request sharing the engine with ``n_others`` requests
    (``fixed_shape``: force the CUDA deterministic path — all-slot decode, per-prompt prefill,
    untiled linears — on any device)."""

    async def main():
        engine, _ = load_engine(str(model_dir), dtype, device, 40, 128, deterministic=deterministic)
        if fixed_shape:
            fwd = engine.forward
            fwd.kernels = dataclasses.replace(fwd.kernels, decode_linear=F.linear, fixed_shape=True)
        task = asyncio.create_task(engine.run())
        target = [5, 17, 42, 99, 7, 3, 250, 11]
        params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, sampling_seed=1234)
        others = [engine.generate(p, SamplingParams(max_new_tokens=4 + (i * 7) % 30, temperature=1.0,
                                                    ignore_eos=True, sampling_seed=i), f"o{i}")
                  for i, p in enumerate(_prompts(n_others, engine.vocab_size))]
        done = await asyncio.gather(engine.generate(target, params, "target"), *others)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return done[0].output_ids, done[0].logprobs

    return asyncio.run(main())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_request_is_bitwise_batch_invariant_in_deterministic_mode(tiny_model_dir, dtype):
    alone, with3, with33 = (_run_engine(tiny_model_dir, True, n, dtype) for n in (0, 3, 33))
    assert with3 == alone and with33 == alone  # tokens and float log-probs, exact equality
    loose = [_run_engine(tiny_model_dir, False, n, dtype) for n in (0, 3, 33)]
    diff = max(abs(a - b) for run in loose[1:] for a, b in zip(run[1], loose[0][1]))
    same_tokens = all(run[0] == loose[0][0] for run in loose)
    print(f"\n{dtype} throughput forward: max |Δ logprob| = {diff:.3e} (alone vs 3/33 others), "
          f"tokens equal: {same_tokens}")


def test_fixed_shape_decode_is_bitwise_batch_invariant_on_cpu(tiny_model_dir):
    # The CUDA deterministic path (every step decodes all 40 slots, idle ones padding into the
    # scratch slot; one prompt per prefill; plain linears) run on the CPU: padding rows must not
    # disturb running requests, and the target's output must not depend on the others.
    alone, with3, with33 = (_run_engine(tiny_model_dir, True, n, fixed_shape=True) for n in (0, 3, 33))
    assert with3 == alone and with33 == alone
    tiled = _run_engine(tiny_model_dir, True, 3)
    assert tiled[0] == alone[0]  # same tokens as the tiled CPU path (log-probs may differ in bits)
    assert max(abs(a - b) for a, b in zip(tiled[1], alone[1])) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_request_is_bitwise_batch_invariant_on_cuda(tiny_model_dir, dtype):
    alone, with3, with33 = (_run_engine(tiny_model_dir, True, n, dtype, "cuda") for n in (0, 3, 33))
    assert with3 == alone and with33 == alone
    loose = [_run_engine(tiny_model_dir, False, n, dtype, "cuda") for n in (0, 3, 33)]
    diff = max(abs(a - b) for run in loose[1:] for a, b in zip(run[1], loose[0][1]))
    print(f"\ncuda {dtype} throughput forward: max |Δ logprob| = {diff:.3e} (alone vs 3/33 others)")


def _sequence_logprobs(lm, seqs: list[list[int]], target: int) -> torch.Tensor:
    from areal_async.trainer.packed_policy import PackedPolicy
    from areal_async.trainer.packing import pack_sequences

    batch = pack_sequences(seqs).to(next(lm.parameters()).device)
    with torch.no_grad():
        logp, _ = PackedPolicy(lm)(batch, 1.0, chunk_tokens=64)
    cu = batch.cu_seqlens.tolist()
    return logp[cu[target] : cu[target + 1]]


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_packed_sequence_logprobs_ignore_neighbours_with_tiled_linears(tiny_model_dir, device, dtype):
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.attention import use_packed_attention

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=dtype).to(device)
    use_packed_attention(lm)
    seqs = _prompts(40, lm.config.vocab_size)
    target = seqs[0] + seqs[1]
    layouts = [([target], 0), ([seqs[2], target, seqs[3]], 1), ([*seqs[4:], target], 36), ([*seqs[4:9], target], 5)]
    plain = [_sequence_logprobs(lm, s, t) for s, t in layouts]
    n = make_linears_batch_invariant(lm)
    assert n == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the LM head
    tiled = [_sequence_logprobs(lm, s, t) for s, t in layouts]
    assert all(torch.equal(t, tiled[0]) for t in tiled[1:])
    diff = max(float((p - plain[0]).abs().max()) for p in plain[1:])
    print(f"\nplain packed forward: max |Δ logprob| = {diff:.3e} across packings")
