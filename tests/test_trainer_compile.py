"""``trainer.compile``: compiled decoder layers and fused-head kernels give the eager log-probs.

CPU, fp32, the inductor C++ backend, through ``build_policy`` (one-rank FSDP2 with gloo, so the
FSDP2 hooks run around the compiled ``forward``). Tolerance: inductor fuses RMSNorm, RoPE, SiLU·mul
and the head's log-softmax and reorders their fp32 reductions; that moves values by a few ulp
(measured: log-probs 4.8e-7, gradients 2.4e-6 at max |g| ≈ 9), so 5e-6 on log-probs and 1e-5
(relative and absolute) on gradients. A wrong attention (e.g. across sequences) or a lost
temperature changes log-probs by > 1e-2 (``test_packing.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from areal_async.config import TrainerConfig
from areal_async.trainer.packing import pack_sequences
from areal_async.devices import free_port

PACKINGS = [
    [[3, 17, 42, 9, 11, 250, 7], [5, 6], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 1], [77]],
    [[4, 8, 15, 16, 23, 42], [7] * 13, [9, 10, 11]],  # other T and B: the recompile with dynamic shapes
]


def test_compile_rejected_in_deterministic_mode(tiny_model_dir):
    from areal_async.trainer.policy import build_policy

    with pytest.raises(ValueError, match="trainer.compile"):
        build_policy(str(tiny_model_dir), TrainerConfig(compile=True), torch.device("cpu"), batch_invariant=True)


def _logp_and_grads(policy, seqs):
    policy.zero_grad(set_to_none=True)
    lp, ent = policy(pack_sequences(seqs), 0.7, 5)
    (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in policy.named_parameters()}
    return lp.detach(), ent, grads


@pytest.mark.slow
def test_compiled_policy_matches_eager(tiny_qwen3_dir, one_torch_thread):
    import torch.distributed as dist

    from areal_async.trainer.policy import build_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        eager = build_policy(str(tiny_qwen3_dir), TrainerConfig(), torch.device("cpu"))
        compiled = build_policy(str(tiny_qwen3_dir), TrainerConfig(compile=True), torch.device("cpu"))
        assert all("forward" in vars(layer) for layer in compiled.lm.model.layers)
        for seqs in PACKINGS + PACKINGS[:1]:  # static, dynamic, then the dynamic graph again
            lp, ent, grads = _logp_and_grads(compiled, seqs)
            ref_lp, ref_ent, ref_grads = _logp_and_grads(eager, seqs)
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=5e-6)
            torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
            assert grads.keys() == ref_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
