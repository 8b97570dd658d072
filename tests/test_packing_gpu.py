"""CUDA path of the packed attention: ``varlen_attn`` in bf16 (marker ``gpu``, deselected by default)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.trainer.attention import packed_kwargs, use_packed_attention
from areal_async.trainer.packed_policy import PackedPolicy, packed_logprobs
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
@pytest.mark.parametrize(("dtype", "path"), [(torch.bfloat16, "flex"), (torch.bfloat16, "varlen"),
                                             (torch.float32, "sdpa")])
def test_tree_packing_matches_unshared_on_cuda(tiny_qwen3_dir, dtype, path, n_prompts, monkeypatch):
    # bf16: the CUDA tree paths (trainer.tree_attention): FlexAttention under the forest's block
    # mask, or varlen_attn over the chains' gathered key runs, against varlen_attn on the unshared
    # packing; both compared with the fp32 unshared result, the tree's error may be no larger than
    # about the unshared bf16 error. fp32: the per-tree sdpa path, tight. Two forest sizes: the
    # second runs the compiled flex kernel at a new node count (dynamic shapes; on the CPU,
    # inductor's C++ flex template failed to build for the second size, torch 2.13).
    from areal_async.trainer import attention
    from areal_async.trainer.tree import pack_tree

    calls = {"flex": [], "varlen": [], "reference": []}
    real_flex, real_ref = attention._flex_tree, attention.bottom_right_varlen_reference
    real_varlen = attention.varlen.varlen_attn
    monkeypatch.setattr(attention, "_flex_tree", lambda *a: calls["flex"].append(1) or real_flex(*a))
    monkeypatch.setattr(attention, "bottom_right_varlen_reference",
                        lambda *a: calls["reference"].append(1) or real_ref(*a))
    def counted_varlen(q, k, *a, **kw):  # True for the tree path's call: key runs longer than queries
        calls["varlen"].append(q.shape[0] != k.shape[0])
        return real_varlen(q, k, *a, **kw)

    monkeypatch.setattr(attention.varlen, "varlen_attn", counted_varlen)
    seqs, head = _forest_seqs(n_prompts=n_prompts)
    results = {}
    for name, dt, pack in (("ref", torch.float32, pack_sequences), ("flat", dtype, pack_sequences),
                           ("tree", dtype, lambda s, h: pack_tree(s, h, attention=path))):
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
    print(f"{dtype} {path}: log-prob error flat {flat_err:.3g} tree {tree_err:.3g}; gradient rel. error flat "
          f"{flat_gerr:.3g} tree {tree_gerr:.3g}; calls {({k: len(v) for k, v in calls.items()})}")
    assert not calls["reference"]  # CUDA never takes the CPU stand-in
    if dtype == torch.float32:
        assert not calls["flex"]
        torch.testing.assert_close(tree_lp, ref_lp, rtol=0, atol=1e-5)
        assert tree_gerr < 1e-5
    else:
        # once per layer of the tree's forward (2 layers); the flat bf16 forward runs varlen_attn
        # with equal query/key runs, the varlen tree path with the longer gathered key runs
        assert len(calls["flex"]) == (2 if path == "flex" else 0)
        assert sum(calls["varlen"]) == (2 if path == "varlen" else 0)
        assert tree_err <= 2 * flat_err + 1e-2 and tree_gerr <= 2 * flat_gerr + 1e-2


def _deterministic_tree_run(rank: int, port: int, model_dir: str, dtype: str, out_path: str,
                            device_type: str = "cuda") -> None:
    """Deterministic mode's settings (``trainer/learner.py``: ``CUBLAS_WORKSPACE_CONFIG`` before CUDA
    starts, ``torch.use_deterministic_algorithms(True)``, batch-invariant linears), one rank of
    FSDP2, ``trainer.share_prefixes=true``: two runs of two ``train_step`` s each from the same
    weights, on the shared-prefix batch of ``tests/support/batches.py`` at a budget of one tree
    (4096) and one that cuts trees (30). Saves the losses, gradients (as the optimizer saw them)
    and weights of every run, the masked ``sdpa`` calls, the determinism warnings, and the error
    text if a step raised. Also: a masked ``sdpa`` forward + backward with only the memory-efficient
    backend allowed, twice at a shape where its backward would split the keys (4 heads, 4096
    keys), compared bit for bit."""
    import os
    import traceback
    import warnings

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from areal_async.config import AlgoConfig, TrainerConfig
    from areal_async.trainer import attention
    from areal_async.trainer.policy import build_policy, full_state_dict, hf_model
    from areal_async.trainer.step import train_step
    from tests.support.batches import shared_prefix_trajectories

    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1)
    result = {"runs": {}, "sdpa_tree_calls": 0, "warnings": [], "error": None, "efficient_equal": None}
    real_tree = attention._sdpa_per_tree

    def counting(*args, **kwargs):
        result["sdpa_tree_calls"] += 1
        return real_tree(*args, **kwargs)

    attention._sdpa_per_tree = counting

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            self.grads.append([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
                               for group in self.param_groups for p in group["params"] if p.grad is not None])
            return super().step(closure)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for budget in (4096, 30):
                for run in range(2):
                    cfg = TrainerConfig(max_tokens_per_mb=budget, dtype=dtype, share_prefixes=True,
                                        skip_zero_advantage=True)
                    policy = build_policy(model_dir, cfg, device, batch_invariant=True)
                    optimizer = Recording(policy.parameters(), lr=1e-3)
                    optimizer.grads = []
                    trajs = shared_prefix_trajectories(int(hf_model(policy).config.vocab_size))
                    metrics = [train_step(policy, optimizer, trajs, AlgoConfig(), cfg, 1.0, device) for _ in range(2)]
                    result["runs"][(budget, run)] = {"metrics": metrics, "grads": optimizer.grads,
                                                     "weights": full_state_dict(policy)}
            if device_type == "cuda":
                g = torch.Generator(device="cpu").manual_seed(0)
                q, k, v = (torch.randn(1, 4, 4096, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
                grad_out = torch.randn(1, 4, 4096, 64, generator=g).to(device, torch.bfloat16)
                idx = torch.arange(4096, device=device)
                mask = (idx[None, :] <= idx[:, None]) & ((idx[:, None] // 1000) == (idx[None, :] // 1000))
                outs = []
                for _ in range(2):
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                        o = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
                        outs.append([o.detach(), *torch.autograd.grad(o, leaves, grad_out)])
                result["efficient_equal"] = all(torch.equal(a, b) for a, b in zip(*outs))
        result["warnings"] = [str(w.message) for w in caught if "determinis" in str(w.message)]
    except Exception:  # noqa: BLE001 - the parent asserts on the text
        result["error"] = traceback.format_exc()
    finally:
        attention._sdpa_per_tree = real_tree
        torch.save(result, out_path)
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_tree_steps_are_bit_identical_on_cuda(tiny_qwen3_dir, dtype, tmp_path):
    # Deterministic mode on a GPU with shared-prefix packing: the tree takes the per-tree masked
    # sdpa (no FlexAttention under deterministic algorithms); torch must raise no "does not have a
    # deterministic implementation" error, and two identical runs must agree bit for bit in loss,
    # gradients and updated weights (after each of two steps, AdamW). Run in a fresh process so
    # that CUBLAS_WORKSPACE_CONFIG is set before cuBLAS starts, as trainer/learner.py does.
    import torch.multiprocessing as mp

    from areal_async.devices import free_port

    out = tmp_path / f"det-{dtype}.pt"
    mp.start_processes(_deterministic_tree_run, args=(free_port(), str(tiny_qwen3_dir), dtype, str(out)),
                       nprocs=1, join=True, start_method="spawn")
    result = torch.load(out, weights_only=False)
    assert result["error"] is None, result["error"]
    print(f"{dtype}: masked sdpa tree calls {result['sdpa_tree_calls']}, determinism warnings {result['warnings']}, "
          f"memory-efficient sdpa fwd+bwd bit-identical: {result['efficient_equal']}")
    assert result["sdpa_tree_calls"] > 0
    assert not result["warnings"], result["warnings"]
    assert result["efficient_equal"]
    for budget in (4096, 30):
        one, two = result["runs"][(budget, 0)], result["runs"][(budget, 1)]
        for s, (m1, m2) in enumerate(zip(one["metrics"], two["metrics"])):
            assert m1["train/loss"] == m2["train/loss"] and m1["train/grad_norm"] == m2["train/grad_norm"], (budget, s)
            assert m1["train/forward_tokens"] < m1["train/tokens"], (budget, s)  # sharing and skipping ran
        assert len(one["grads"]) == len(two["grads"]) == 2
        for s, (g1, g2) in enumerate(zip(one["grads"], two["grads"])):
            assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True)), f"budget {budget}: gradients of step {s}"
        for name, w in one["weights"].items():
            assert torch.equal(w, two["weights"][name]), f"budget {budget}: {name}"
