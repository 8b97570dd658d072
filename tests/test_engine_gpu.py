"""The embedded engine on CUDA (marker ``gpu``, deselected by default): greedy tokens and log-probs
against HF's own forward on the same weights, in fp32 and bf16."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_async.inference.sampling import SamplingParams
from areal_async.inference.server import load_engine

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 11, 120, 7] * 3, [3, 4], list(range(30, 70)), [77] * 5]


async def _generate(engine, params: SamplingParams):
    task = asyncio.create_task(engine.run())
    try:
        return await asyncio.gather(*(engine.generate(p, params, f"r{i}") for i, p in enumerate(PROMPTS)))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_engine_matches_hf_forward_on_cuda(tiny_qwen3_dir, dtype, tol):
    # Greedy output of the batched engine, then HF's forward on prompt + output (teacher forcing):
    # each engine token must be HF's argmax unless HF's top-2 margin is within the tolerance (a
    # near-tie that rounding may break either way), and the log-probs must agree within ``tol``.
    engine, _ = load_engine(str(tiny_qwen3_dir), dtype, "cuda", max_running_requests=8, max_seq_len=128)
    model = engine.forward.model
    outs = asyncio.run(_generate(engine, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.output_ids) == 24
        ids = torch.tensor([prompt + out.output_ids], device="cuda")
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(out.output_ids, device="cuda")
        margin = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
        assert bool((margin <= tol).all()), f"engine token not HF's argmax: margins {margin.tolist()}"
        ref = torch.log_softmax(logits, -1).gather(-1, chosen[:, None])[:, 0]
        diff = (torch.tensor(out.logprobs, device="cuda") - ref).abs().max().item()
        assert diff <= tol, f"log-prob differs from HF by {diff}"
