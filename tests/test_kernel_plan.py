"""The forward's kernel plan: the kernels chosen for each device, dtype and mode (``kernels.py``'s table)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from areal_async.batch_invariant import tiled_linear
from areal_async.embedded.engine.kernels import KernelPlan, plan_kernels

# (device, dtype, batch_invariant) -> (prefill linear, decode linear, prefill attention, decode attention,
#                                      fused layers, fixed shape, full span, cuda graph), Triton available
TABLE = {
    ("cpu", torch.float32, False): (F.linear, F.linear, "per_sequence", "matmul", False, False, False, False),
    ("cpu", torch.bfloat16, False): (F.linear, F.linear, "per_sequence", "matmul", False, False, False, False),
    ("cpu", torch.float32, True): (tiled_linear, tiled_linear, "per_sequence", "matmul", False, False, True, False),
    ("cpu", torch.bfloat16, True): (tiled_linear, tiled_linear, "per_sequence", "matmul", False, False, True, False),
    ("cuda", torch.bfloat16, False): (F.linear, F.linear, "varlen", "triton", True, False, False, True),
    ("cuda", torch.float16, False): (F.linear, F.linear, "varlen", "triton", True, False, False, True),
    ("cuda", torch.bfloat16, True): (tiled_linear, F.linear, "per_sequence", "triton", True, True, True, True),
    ("cuda", torch.float32, True): (tiled_linear, F.linear, "per_sequence", "triton", True, True, True, True),
    ("cuda", torch.float32, False): (F.linear, F.linear, "per_sequence", "triton", True, False, False, True),
}


def _expect(case):
    fields = [f.name for f in dataclasses.fields(KernelPlan)]
    return KernelPlan(**dict(zip(fields, TABLE[case])))


@pytest.mark.parametrize("case", list(TABLE), ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-bi{int(c[2])}")
def test_plan_per_device_dtype_and_mode(case):
    device, dtype, bi = case
    plan = plan_kernels(device, dtype, bi, 128, triton_available=True, fusable_layers=True)
    assert plan == _expect(case)


def test_plan_falls_back_without_triton_or_fusable_layers():
    no_triton = plan_kernels("cuda", torch.bfloat16, False, 128, triton_available=False, fusable_layers=True)
    assert (no_triton.decode_attention, no_triton.fused_layers) == ("matmul", False)
    odd_dim = plan_kernels("cuda", torch.bfloat16, False, 96, triton_available=True, fusable_layers=True)
    assert (odd_dim.decode_attention, odd_dim.fused_layers) == ("matmul", False)
    gelu = plan_kernels("cuda", torch.bfloat16, False, 128, triton_available=True, fusable_layers=False)
    assert (gelu.decode_attention, gelu.fused_layers) == ("triton", False)
    eager = plan_kernels("cuda", torch.bfloat16, False, 128, triton_available=True, fusable_layers=True,
                         cuda_graph=False)
    assert not eager.cuda_graph
    assert not plan_kernels("cpu", torch.float32, False, 128, triton_available=True, fusable_layers=True).cuda_graph


def test_plan_rejects_an_unknown_attention_path():
    plan = _expect(("cpu", torch.float32, False))
    with pytest.raises(ValueError, match="'flash'"):
        dataclasses.replace(plan, decode_attention="flash")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_on_cpu_builds_the_table_plan(tiny_model_dir, dtype, deterministic):
    from areal_async.embedded.loading import load_engine

    engine, _ = load_engine(str(tiny_model_dir), dtype, "cpu", 4, 64, deterministic=deterministic)
    fwd = engine.forward
    assert fwd.kernels == _expect(("cpu", getattr(torch, dtype), deterministic))
    assert fwd.graphs is None and fwd.cache.keys_transposed
