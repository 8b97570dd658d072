"""``tools/bench_tree_attention.py`` on CPU at a tiny shape: its layouts and variants agree with
the dense-mask float64 reference (the logic the GPU run relies on; nothing is timed here)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from tests.support import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_tree_attention", REPO / "tools" / "bench_tree_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


TINY = ["--device", "cpu", "--groups", "3", "--samples", "3", "--prompt-len", "20,40", "--response-len", "1,30",
        "--iters", "1", "--warmup", "0", "--heads", "4,2,16"]


@pytest.mark.parametrize("max_tokens", ["4096", "60"])  # one micro-batch of whole trees; a cut tree
def test_cpu_variants_match_the_dense_reference(bench, capsys, max_tokens, one_torch_thread):
    assert bench.main(TINY + ["--max-tokens", max_tokens]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["a"], ["c"], ["d"], ["ref"])}
    assert set(rows) == {"a", "c", "d", "ref"}, out
    assert all(line.rstrip().endswith("ok") for line in rows.values()), out


def test_layout_chains_read_each_node_s_ancestors(bench):
    # Shared 4-token prompt, two responses, and one sequence a prefix of another: the chains'
    # key runs are each chain's root path, and every position maps to the node of its token.
    seqs = [[5, 6, 7, 8, 1, 2], [5, 6, 7, 8, 3], [5, 6, 7, 8, 1, 2, 9], [4, 4]]
    lay = bench.build_layout(seqs)
    flat = np.concatenate(seqs)
    assert lay.num_nodes == 4 + 2 + 1 + 1 + 2
    assert lay.node_of.numel() == len(flat)
    runs_q = np.diff(lay.cu_q.numpy()).tolist()
    runs_k = np.diff(lay.cu_k.numpy()).tolist()
    # pre-order: tree [4,4] first (sorted), then the prompt, the branch 1-2-9, the branch 3
    assert runs_q == [2, 4, 3, 1] and runs_k == [2, 4, 7, 5]
    assert lay.key_index.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 9]


def test_a_broken_key_run_is_caught(bench, capsys, monkeypatch, one_torch_thread):
    real = bench.build_layout

    def without_first_ancestor(seqs):  # every chain but the roots loses its root's K/V
        lay = real(seqs)
        keep = torch.ones(lay.key_index.numel(), dtype=torch.bool)
        starts = lay.cu_k[:-1].long()
        lens = lay.cu_k.diff() - lay.cu_q.diff()
        keep[starts[lens > 0]] = False
        lay.key_index = lay.key_index[keep]
        lay.cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), (lay.cu_k.diff() - (lens > 0).int()).cumsum(0).int()])
        lay.max_k = int(lay.cu_k.diff().max())
        return lay

    monkeypatch.setattr(bench, "build_layout", without_first_ancestor)
    assert bench.main(TINY + ["--max-tokens", "4096"]) == 1
    out = capsys.readouterr().out
    assert "OVER TOLERANCE" in out and "FAILED: d" in out, out
