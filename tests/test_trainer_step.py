"""One training step: 2 gloo ranks (FSDP2) give the same update as 1 rank; parameters change.

Both runs use SGD without clipping so the parameter update is proportional to the gradient: a
wrong global-token-mean (e.g. a missing world-size factor, or a micro-batch counted twice) shows
up as a 2× difference, far above the tolerance. Tolerance: 1e-6 absolute on parameters after an
update of lr·grad with lr = 0.1 (updates here are ~1e-4–1e-2); fp32, only the reduction order
differs between the runs.
"""

from __future__ import annotations

import os
import sys

import msgspec
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor

from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.types import Array, Trajectory
from tests.support.batches import make_trajectories, shared_prefix_trajectories


def _run_rank(rank: int, world: int, rendezvous: str, model_dir: str, out_path: str, parallel: str,
              device_type: str = "cpu", dtype: str = "float32", all_equal: bool = False) -> None:
    import faulthandler

    import torch.distributed as dist

    from areal_async.trainer.policy import build_policy, full_state_dict, hf_model
    from areal_async.trainer.step import train_step

    faulthandler.enable()  # a crash in a rank prints its Python stack to the test's output
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    # a file rendezvous: no port to choose, so none another process can take first
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=world)
    try:
        cfg = TrainerConfig(max_tokens_per_mb=24, grad_clip=1e6, parallel=parallel, dtype=dtype)
        policy = build_policy(model_dir, cfg, device)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        vocab = int(hf_model(policy).config.vocab_size)
        trajs = make_trajectories(vocab)
        if all_equal:  # every group's rewards equal: every sequence is skipped, each rank runs a dummy pass
            trajs = [msgspec.structs.replace(t, samples=[msgspec.structs.replace(x, reward=5.0) for x in t.samples])
                     for t in trajs]
        metrics = train_step(policy, optimizer, trajs, AlgoConfig(), cfg, 1.0, device, version=0)
        state = full_state_dict(policy)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, out_path)
        dist.barrier()  # no rank tears the group down while another still uses it, as trainer/main.py does
    finally:
        dist.destroy_process_group()
    # leave without interpreter finalization, as trainer/main.py does: a destroyed gloo group's
    # C++ threads can still be joinable then, and their destructors abort the process (SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(world: int, model_dir, tmp_path, parallel: str = "fsdp2", device_type: str = "cpu",
           dtype: str = "float32", all_equal: bool = False) -> dict:
    out = tmp_path / f"out-{world}-{parallel}-{device_type}-{dtype}-{all_equal}.pt"
    rendezvous = tmp_path / f"rendezvous-{out.stem}"
    mp.start_processes(_run_rank, args=(world, str(rendezvous), str(model_dir), str(out), parallel, device_type, dtype,
                                        all_equal),
                       nprocs=world, join=True, start_method="spawn")
    return torch.load(out)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory) -> dict:
    """``_train``'s fp32 FSDP2 step on one rank, the reference of the tests below."""
    return _train(1, tiny_model_dir, tmp_path_factory.mktemp("one-rank"))


def test_two_ranks_match_one_rank(one_rank, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    before = load_file(str(tiny_model_dir / "model.safetensors"))
    one = one_rank
    two = _train(2, tiny_model_dir, tmp_path)
    changed = [k for k in before if not torch.equal(before[k], one["state"][k])]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"
    for k, v in one["state"].items():
        torch.testing.assert_close(two["state"][k], v, rtol=0, atol=1e-6, msg=k)
    for k in ("train/loss", "train/grad_norm", "train/entropy", "train/importance_weight", "train/tokens"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-5), k
    # behaviour vs trainer log-probs: sums and maxima reduced over the ranks (sequence means too)
    for k in ("train/logprob_diff_tokens", "train/logprob_diff_mean", "train/logprob_diff_max", "train/mismatch/seqs",
              "train/mismatch/kl", "train/mismatch/ess", "train/mismatch/chi2_seq", "train/mismatch/log_ppl_diff_min"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-5), k
    assert one["metrics"]["train/logprob_diff_tokens"] == one["metrics"]["train/mismatch/tokens"] > 0
    m = one["metrics"]
    # π_prox = π_θ in the only update: ratio 1, nothing clipped; behaviour log-probs are made up, so
    # the importance weights are large and many are capped at 5 (AlgoConfig default).
    assert m["train/ratio"] == pytest.approx(1.0) and m["train/clip_ratio"] == 0.0
    assert 0 < m["train/behav_capped_ratio"] <= 1 and m["train/grad_norm"] > 0


@pytest.mark.slow
def test_ddp_matches_fsdp2(tiny_model_dir, tmp_path):
    fsdp = _train(2, tiny_model_dir, tmp_path, "fsdp2")
    ddp = _train(2, tiny_model_dir, tmp_path, "ddp")
    for k, v in fsdp["state"].items():
        torch.testing.assert_close(ddp["state"][k], v, rtol=0, atol=1e-6, msg=k)


@pytest.mark.gpu
def test_two_gpus_nccl_match_one_gpu(tiny_model_dir, tmp_path):
    # fp32 on CUDA (packed attention falls back to per-sequence sdpa); then a bf16 run (varlen).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = _train(1, tiny_model_dir, tmp_path, device_type="cuda")
    two = _train(2, tiny_model_dir, tmp_path, device_type="cuda")
    for k, v in one["state"].items():
        torch.testing.assert_close(two["state"][k], v, rtol=0, atol=1e-5, msg=k)
    bf16 = _train(2, tiny_model_dir, tmp_path, device_type="cuda", dtype="bfloat16")
    from safetensors.torch import load_file

    before = load_file(str(tiny_model_dir / "model.safetensors"))
    assert bf16["metrics"]["train/grad_norm"] > 0
    assert not torch.equal(bf16["state"]["model.layers.0.self_attn.q_proj.weight"].float(),
                           before["model.layers.0.self_attn.q_proj.weight"])


def _initial_logprobs(model_dir, seqs, temperature: float) -> list[Tensor]:
    """log π(token t+1 | tokens ≤ t) at temperature ``temperature`` of each sequence ``[L]`` (0
    off the loss mask) under the checkpoint's weights: a plain HF forward per sequence, no packing."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s.ids])
            logp = torch.log_softmax(lm(ids).logits[0] / temperature, dim=-1)
            per_token = torch.zeros(len(s.ids))
            per_token[:-1] = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            out.append(torch.where(s.loss_mask, per_token, 0.0))
    return out


def test_ppo_minibatches_recompute_prox(tiny_model_dir, monkeypatch):
    # algo.ppo_minibatches = 2: groups 0–1, then groups 2–3, one AdamW update each. π_prox is the
    # policy before the step's first update for both (trainer/step.py: one no-grad proximal pass
    # over the whole batch), so every proximal log-prob the loss receives equals the checkpoint's
    # own log-prob of that token (recomputed here by a plain HF forward per sequence, at the
    # rollout temperature), in the second minibatch too, where π_θ has moved (the first update,
    # lr 1e-2, changes log-probs by far more than the tolerance). The first minibatch runs before
    # any update: there π_θ = π_prox bitwise (the same forward on the same weights). With one
    # minibatch π_prox is π_θ itself, detached. Tolerance against the plain forward: the log-probs
    # are about -6 nats, where one float32 ulp is 2**-21 ≈ 4.8e-7 (packed and per-sequence
    # attention differ by about one); atol 4e-6 is 8 ulps, while the broken variants (π_prox at
    # temperature 1, or taken after the first update) are off by 0.1–0.6.
    from transformers import AutoModelForCausalLM

    from areal_async.trainer import plan as plan_module
    from areal_async.algo import objectives as objectives_module
    from areal_async.trainer import step as step_module
    from areal_async.trainer.attention import use_packed_attention
    from areal_async.trainer.packed_policy import PackedPolicy

    torch.set_num_threads(1)
    temperature = 0.7
    trajs = make_trajectories(384)
    seqs = plan_module.build_sequences(trajs, AlgoConfig())
    expected = _initial_logprobs(tiny_model_dir, seqs, temperature)
    first_minibatch = set(range(len(seqs) // 2))  # groups 0–1: 2 samples each

    packed, calls = [], []  # sequence indices of each packed micro-batch; what each loss call got
    pack, loss = plan_module.pack_micro_batch, objectives_module.decoupled_ppo_loss

    def recording_pack(seqs, idx, *args, **kwargs):
        packed.append(list(idx))
        return pack(seqs, idx, *args, **kwargs)

    def recording_loss(theta, prox, behav, advantages, mask, *args, **kwargs):
        calls.append((packed[-1], theta.detach().clone(), prox.detach().clone(), mask.clone()))
        return loss(theta, prox, behav, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(plan_module, "pack_micro_batch", recording_pack)
    monkeypatch.setattr(objectives_module, "decoupled_ppo_loss", recording_loss)
    results = {}
    for n in (1, 2):
        calls.clear()
        lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert lm.config.vocab_size == 384
        use_packed_attention(lm)
        policy = PackedPolicy(lm)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        results[n] = step_module.train_step(policy, optimizer, trajs, AlgoConfig(ppo_minibatches=n),
                                            TrainerConfig(max_tokens_per_mb=24), temperature, torch.device("cpu"))
        seen = {i for idx, *_ in calls for i in idx}
        assert {i for i in range(len(seqs)) if plan_module.runs_forward(seqs[i])} <= seen
        for idx, theta, prox, mask in calls:
            assert idx, "one rank runs no dummy micro-batch"
            if n == 1:
                assert torch.equal(prox, theta)
                continue
            want = torch.cat([expected[i] for i in idx])
            torch.testing.assert_close(prox[mask], want[mask], rtol=0, atol=4e-6)
            if set(idx) <= first_minibatch:
                assert torch.equal(theta[mask], prox[mask])
            else:
                assert not set(idx) & first_minibatch
                assert (theta[mask] - prox[mask]).abs().max() > 1e-2  # π_θ moved; π_prox did not
        if n == 2:  # the second minibatch ran (group 2 has mixed rewards)
            assert any(mask.any() and not set(idx) & first_minibatch for idx, _, _, mask in calls)
    assert results[1]["train/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert abs(results[2]["train/ratio"] - 1.0) > 1e-4 and results[2]["train/approx_kl"] > 0
    with pytest.raises(ValueError, match="ppo_minibatches"):
        step_module.train_step(policy, optimizer, trajs, AlgoConfig(ppo_minibatches=5), TrainerConfig(), 1.0,
                               torch.device("cpu"))


def test_bf16_compute_keeps_fp32_master_weights(one_rank, tiny_model_dir, tmp_path):
    # trainer.dtype=bfloat16: FSDP2 gathers bf16 parameters for compute, the update lands in the
    # fp32 master weights. Entropy (≈ log 384 ≈ 5.95 nats) agrees with fp32 to bf16 precision.
    fp32 = one_rank
    bf16 = _train(1, tiny_model_dir, tmp_path, dtype="bfloat16")
    assert all(v.dtype == torch.float32 for v in bf16["state"].values())
    assert bf16["metrics"]["train/entropy"] == pytest.approx(fp32["metrics"]["train/entropy"], abs=2e-2)
    delta_fp32 = bf16["state"]["model.norm.weight"] - fp32["state"]["model.norm.weight"]
    assert delta_fp32.abs().max() < 0.05 * (fp32["state"]["model.norm.weight"] - 1).abs().max() + 1e-3


def test_a_non_finite_gradient_skips_the_update(tiny_model_dir):
    # one NaN behaviour log-prob makes the loss and every gradient NaN: the optimizer step is
    # skipped (the weights stay finite and unchanged) and counted in train/skipped_updates
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.attention import use_packed_attention
    from areal_async.trainer.packed_policy import PackedPolicy
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_packed_attention(lm)
    policy = PackedPolicy(lm)
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    trajs = make_trajectories(lm.config.vocab_size)
    bad = trajs[0].samples[0].behav_logprobs.numpy().copy()
    bad[0] = np.nan
    trajs[0].samples[0] = msgspec.structs.replace(trajs[0].samples[0], behav_logprobs=Array.of(bad, "float32"))
    metrics = train_step(policy, optimizer, trajs, AlgoConfig(), TrainerConfig(max_tokens_per_mb=24), 1.0,
                         torch.device("cpu"))
    changed = [n for n, p in lm.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, f"updated by a NaN gradient: {changed[:3]}"
    assert metrics["train/skipped_updates"] == 1.0
    good = train_step(policy, optimizer, make_trajectories(lm.config.vocab_size), AlgoConfig(),
                      TrainerConfig(max_tokens_per_mb=24), 1.0, torch.device("cpu"))
    assert good["train/skipped_updates"] == 0.0
    assert not all(torch.equal(p, before[n]) for n, p in lm.named_parameters())
    assert all(torch.isfinite(p).all() for p in lm.parameters())


def test_two_ranks_with_every_sequence_skipped(tiny_model_dir, tmp_path):
    # All advantages 0: no sequence runs, yet both ranks run one dummy pass each (the same FSDP2
    # collectives), the gradient is exactly 0 and SGD leaves every weight as it was.
    from safetensors.torch import load_file

    before = load_file(str(tiny_model_dir / "model.safetensors"))
    two = _train(2, tiny_model_dir, tmp_path, all_equal=True)
    m = two["metrics"]
    assert m["train/skipped_seqs"] == 8 and m["train/forward_tokens"] == 0
    assert "train/entropy" not in m and "train/importance_weight" not in m  # no tokens to average (not 0)
    assert m["train/loss"] == 0 and m["train/grad_norm"] == 0 and m["train/tokens"] > 0
    for k, v in before.items():
        assert torch.equal(two["state"][k], v), k


def _tiny_policy(model_dir):
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.attention import use_packed_attention
    from areal_async.trainer.packed_policy import PackedPolicy

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_attention(lm)
    return PackedPolicy(lm)


def _step(model_dir, trajs, n_mini: int = 1, **trainer_kwargs) -> tuple[dict, dict]:
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _tiny_policy(model_dir)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    cfg = TrainerConfig(grad_clip=1e6, **trainer_kwargs)
    metrics = train_step(policy, optimizer, trajs, AlgoConfig(ppo_minibatches=n_mini), cfg, 1.0, torch.device("cpu"))
    return metrics, {n: p.detach().clone() for n, p in policy.lm.named_parameters()}


@pytest.mark.parametrize("n_mini", [1, 2])
def test_exact_savings_give_the_same_update(tiny_model_dir, n_mini):
    # SGD, no clipping: the update is lr · gradient, so a wrong denominator or a missing/extra
    # gradient share is a visible difference (updates ~1e-4–1e-2; tolerance 1e-6). Budgets: 4096
    # (one tree of all prompts) and 30 tokens (the tree cut into sub-trees, the preamble repeated).
    # All variants must give the baseline's weights, loss and clip fraction.
    trajs = shared_prefix_trajectories(384)
    base, base_w = _step(tiny_model_dir, trajs, n_mini, skip_zero_advantage=False, share_prefixes=False)
    assert base["train/forward_tokens"] == base["train/tokens"] and base["train/skipped_seqs"] == 0
    for budget in (4096, 30):
        for skip, share in ((True, False), (False, True), (True, True)):
            m, w = _step(tiny_model_dir, trajs, n_mini, max_tokens_per_mb=budget, skip_zero_advantage=skip,
                         share_prefixes=share)
            tag = f"budget {budget} skip {skip} share {share}"
            for name, v in base_w.items():
                torch.testing.assert_close(w[name], v, rtol=0, atol=1e-6, msg=f"{tag}: {name}")
            for k in ("train/loss", "train/clip_ratio", "train/tokens", "train/grad_norm"):
                assert m[k] == pytest.approx(base[k], rel=1e-5, abs=1e-9), f"{tag}: {k}"
            assert m["train/forward_tokens"] < base["train/forward_tokens"], tag
            assert m["train/skipped_seqs"] == (9 if skip else 0), tag
            if not skip:  # nothing skipped: the log-prob statistics are those of the baseline too
                for k in ("train/entropy", "train/importance_weight", "train/ratio", "train/approx_kl"):
                    assert m[k] == pytest.approx(base[k], rel=1e-5, abs=1e-9), f"{tag}: {k}"
            if n_mini == 1:  # π_prox = π_θ: the mean ratio over the tokens run is exactly 1
                assert m["train/ratio"] == pytest.approx(1.0, abs=1e-6), tag


def test_zero_advantage_skip_off_for_a_kl_term_and_by_switch(tiny_model_dir):
    # the switch turns the skip off; with it on, the 8 sequences of groups 1 and 3 and the empty
    # response of group 2 are not run
    trajs = shared_prefix_trajectories(384)
    on, _ = _step(tiny_model_dir, trajs, share_prefixes=False)
    off, _ = _step(tiny_model_dir, trajs, share_prefixes=False, skip_zero_advantage=False)
    assert on["train/skipped_seqs"] == 9 and off["train/skipped_seqs"] == 0
    assert on["train/forward_tokens"] < off["train/forward_tokens"] == off["train/tokens"]


def test_the_plan_is_a_function_of_the_batch(tiny_model_dir):
    # Same batch, trajectories and samples handed over in another order: the same sequences are
    # skipped, the same micro-batches made, and the update is bitwise the same.
    from areal_async.trainer.plan import assign_micro_batches, build_sequences, runs_forward

    trajs = shared_prefix_trajectories(384)
    shuffled = [msgspec.structs.replace(t, samples=t.samples[::-1]) for t in trajs[::-1]]
    plans = []
    for batch in (trajs, shuffled):
        seqs = build_sequences(batch, AlgoConfig())
        run = [i for i in range(len(seqs)) if runs_forward(seqs[i])]
        plans.append((run, assign_micro_batches(seqs, run, 30, 2, True), [seqs[i].ids for i in run]))
    assert plans[0] == plans[1]
    assert len(plans[0][1][0]) == len(plans[0][1][1])  # both ranks run as many passes
    (m1, w1), (m2, w2) = _step(tiny_model_dir, trajs, max_tokens_per_mb=30), _step(tiny_model_dir, shuffled,
                                                                                   max_tokens_per_mb=30)
    assert m1 == m2
    assert all(torch.equal(w1[n], w2[n]) for n in w1)


def test_naive_ppo_runs_no_proximal_forward(tiny_model_dir):
    # algo.objective=naive takes π_prox = π_behav: with two minibatches the decoupled step runs a
    # no-grad proximal pass over every micro-batch first, the naive step none; both train the same
    # micro-batches with grad. The naive statistics: w = 1 on every token, nothing capped.
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    counts, results = {}, {}
    for decoupled in (True, False):
        policy = _tiny_policy(tiny_model_dir)
        lm = policy.lm
        seen = {True: 0, False: 0}
        policy.register_forward_hook(lambda m, a, o: seen.__setitem__(torch.is_grad_enabled(),
                                                                      seen[torch.is_grad_enabled()] + 1))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        results[decoupled] = train_step(policy, optimizer, make_trajectories(lm.config.vocab_size),
                                        AlgoConfig(ppo_minibatches=2, objective="decoupled" if decoupled else "naive"),
                                        TrainerConfig(max_tokens_per_mb=24), 1.0, torch.device("cpu"))
        counts[decoupled] = dict(seen)
    assert counts[True][False] == counts[True][True] > 0, counts
    assert counts[False] == {True: counts[True][True], False: 0}, counts
    naive = results[False]
    assert naive["train/importance_weight"] == pytest.approx(1.0) and naive["train/behav_capped_ratio"] == 0.0
    assert results[True]["train/behav_capped_ratio"] > 0  # sample (2, 1)'s weights exceed the cap
    assert set(naive) == set(results[True])  # the same metric names


def _own_logprobs(policy, trajs: list[Trajectory]) -> list[Trajectory]:
    """``trajs`` with every behaviour log-prob replaced by the policy's own (fresh, η = 0 data)."""
    from areal_async.trainer.packed_policy import packed_logprobs
    from areal_async.trainer.packing import pack_sequences

    out = []
    with torch.no_grad():
        for t in trajs:
            samples = []
            for s in t.samples:
                prompt, resp = t.prompt_ids.tolist(), s.output_ids.tolist()
                logp = packed_logprobs(policy, pack_sequences([prompt + resp]), 1.0)[0]
                own = logp[len(prompt) - 1: len(prompt) - 1 + len(resp)].numpy()
                samples.append(msgspec.structs.replace(s, behav_logprobs=Array.of(own, "float32")))
            out.append(msgspec.structs.replace(t, samples=samples))
    return out


def test_naive_and_decoupled_steps_coincide_on_fresh_data(tiny_model_dir):
    # Behaviour log-probs = the policy's own (η = 0, one update per step): π_behav = π_prox = π_θ at
    # the forward, so both objectives give the same update; with the made-up (stale) behaviour
    # log-probs of make_trajectories they differ. SGD, lr 0.1: a gradient difference shows 1:1.
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _tiny_policy(tiny_model_dir)
    lm = policy.lm
    fresh = _own_logprobs(policy, make_trajectories(lm.config.vocab_size))
    stale = make_trajectories(lm.config.vocab_size)
    out = {}
    for data, trajs in (("fresh", fresh), ("stale", stale)):
        for decoupled in (True, False):
            policy = _tiny_policy(tiny_model_dir)
            lm = policy.lm
            optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
            m = train_step(policy, optimizer, trajs, AlgoConfig(objective="decoupled" if decoupled else "naive"),
                           TrainerConfig(max_tokens_per_mb=24, grad_clip=1e6), 1.0, torch.device("cpu"))
            out[data, decoupled] = m, {n: p.detach().clone() for n, p in lm.named_parameters()}
    (m_d, w_d), (m_n, w_n) = out["fresh", True], out["fresh", False]
    for key in ("train/loss", "train/clip_ratio", "train/importance_weight", "train/ratio", "train/behav_kl",
                "train/grad_norm"):
        assert m_n[key] == pytest.approx(m_d[key], rel=1e-5, abs=1e-6), key
    assert m_d["train/importance_weight"] == pytest.approx(1.0, abs=1e-5)
    for name in w_d:
        torch.testing.assert_close(w_n[name], w_d[name], rtol=0, atol=1e-6, msg=name)
    (m_d, w_d), (m_n, w_n) = out["stale", True], out["stale", False]
    assert m_n["train/clip_ratio"] > 0 and m_d["train/clip_ratio"] == 0.0  # naive r = π_θ/π_behav ≠ 1
    assert max((w_n[n] - w_d[n]).abs().max().item() for n in w_d) > 1e-4


def test_pack_takes_the_tree_attention_path():
    from areal_async.trainer.plan import SeqTensors, pack_micro_batch

    def seq(ids):
        n = len(ids)
        pos = torch.arange(n)
        return SeqTensors(ids, torch.zeros(n), (pos >= 2) & (pos < n - 1), torch.ones(n))  # loss rows have a next token

    seqs = [seq([1, 2, 3, 4]), seq([1, 2, 3, 5, 6])]
    tree = pack_micro_batch(seqs, [0, 1], True, "varlen")
    assert tree.attention == "varlen"
    assert tree.chains.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5]
    assert "tree_chains" in tree.model_inputs() and "tree_block_mask" not in tree.model_inputs()
    plain = pack_micro_batch(seqs, [0, 1], True)
    assert plain.attention == "sdpa" and plain.chains is None and "tree_chains" not in plain.model_inputs()


def test_train_step_rejects_varlen_tree_attention_on_cpu():
    from areal_async.trainer.step import train_step

    with pytest.raises(ValueError, match="trainer.tree_attention=varlen needs CUDA.*runs on CPU"):
        train_step(None, None, make_trajectories(vocab=50), AlgoConfig(), TrainerConfig(tree_attention="varlen"), 1.0,
                   torch.device("cpu"))


@pytest.mark.parametrize("objective", ["tis", "mis", "icepop", "m2po", "gspo"])
def test_each_objective_takes_a_step_and_logs_its_own_statistics(tiny_model_dir, objective):
    # Two minibatches (a proximal pass first), prefix trees (the groups share their prompts), the
    # made-up stale behaviour log-probs of make_trajectories: the step moves the weights, and the
    # objective's own statistics come out under train/, finite; no weight is NaN.
    from areal_async.algo.objectives import OBJECTIVES
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _tiny_policy(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in policy.lm.named_parameters()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    algo = AlgoConfig(objective=objective, ppo_minibatches=2, gspo_eps_clip=0.2, gspo_eps_clip_high=0.2)
    m = train_step(policy, optimizer, make_trajectories(policy.lm.config.vocab_size), algo,
                   TrainerConfig(max_tokens_per_mb=24), 1.0, torch.device("cpu"))
    own = [f"train/{k}" for k in OBJECTIVES[objective].stat_keys]
    assert set(own) <= set(m) and all(np.isfinite(m[k]) for k in own), m
    assert m["train/skipped_updates"] == 0.0 and np.isfinite(m["train/loss"])
    after = dict(policy.lm.named_parameters())
    assert any(not torch.equal(after[n], before[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())


def _lr0_step(model_dir, trajs, algo: AlgoConfig, version: int | None = None, batch_invariant: bool = False,
              **trainer_kwargs) -> dict:
    """``train_step`` of the tiny model at lr 0 (SGD: the weights never move, so every forward of
    the step sees the checkpoint's policy)."""
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _tiny_policy(model_dir)
    if batch_invariant:
        from areal_async.batch_invariant import make_linears_batch_invariant

        make_linears_batch_invariant(policy.lm)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    cfg = TrainerConfig(max_tokens_per_mb=24, grad_clip=1e6, **trainer_kwargs)
    return train_step(policy, optimizer, trajs, algo, cfg, 1.0, torch.device("cpu"), version=version)


def _equal_rewards(t: Trajectory) -> Trajectory:
    return msgspec.structs.replace(t, samples=[msgspec.structs.replace(s, reward=5.0) for s in t.samples])


@pytest.mark.parametrize("objective", ["decoupled", "naive", "icepop"])
def test_a_skipped_minibatch_leaves_the_log_prob_statistics_alone(tiny_model_dir, objective):
    # algo.ppo_minibatches = 2 over groups 0–1 and 2–3; groups 2 and 3 have all-equal rewards, so
    # the second minibatch runs no sequence (nor does group 1's empty response). At lr 0 the
    # policy never moves: the statistics that need log-probs must be those of the one minibatch
    # that ran, i.e. of a one-minibatch step on groups 0–1 alone. They used to be averaged over
    # both minibatches with the skipped one adding 0: ratio 0.5 (decoupled: π_θ = π_prox, so 1 is
    # right), importance weight 0.5 (naive: w = 1), entropy and behav_kl halved. The gradient
    # statistics (loss, clip fraction) are over every loss token and were right.
    from areal_async.algo.objectives import OBJECTIVES

    trajs = make_trajectories(384)
    trajs[2] = _equal_rewards(trajs[2])
    algo = AlgoConfig(ppo_minibatches=2, objective=objective)
    both = _lr0_step(tiny_model_dir, trajs, algo)
    alone = _lr0_step(tiny_model_dir, trajs[:2], AlgoConfig(ppo_minibatches=1, objective=objective))
    unskipped = _lr0_step(tiny_model_dir, trajs, algo, skip_zero_advantage=False)
    assert both["train/skipped_seqs"] == 5 and unskipped["train/skipped_seqs"] == 0
    if objective != "naive":
        assert both["train/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert unskipped["train/ratio"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert both["train/importance_weight"] == pytest.approx(1.0, abs=1e-6)
    own = [f"train/{k}" for k in OBJECTIVES[objective].stat_keys]  # icepop_masked_ratio: over the tokens run too
    for k in ["train/ratio", "train/importance_weight", "train/entropy", "train/behav_kl", "train/approx_kl",
              "train/behav_capped_ratio", *own]:
        assert both[k] == pytest.approx(alone[k], rel=1e-6, abs=1e-9), k
    assert both["train/entropy"] > 5  # ≈ log 384 ≈ 5.95 nats for the random tiny model (halved: ≈ 3)
    for k in ("train/loss", "train/clip_ratio", "train/grad_norm"):  # skipping changes neither
        assert both[k] == pytest.approx(unskipped[k], rel=1e-5, abs=1e-9), k


def test_engine_and_trainer_logprobs_compared_at_the_trainer_version(tiny_model_dir):
    # train/logprob_diff_*: behaviour log-probs vs the trainer's at the version it holds, over the
    # tokens that version sampled. Behaviour log-probs here = the policy's own, each sequence
    # forwarded alone (tiled linears, no shared prefixes: a sequence's log-probs are then bitwise
    # independent of its packing), so at version 0 every compared token agrees exactly: max 0.
    # Sample (0, 0) is then marked as sampled by version 1 with log-probs off by 0.25: its tokens
    # leave logprob_diff_* (the trainer does not hold version 1) but stay in mismatch/*.
    from areal_async.batch_invariant import make_linears_batch_invariant

    policy = _tiny_policy(tiny_model_dir)
    make_linears_batch_invariant(policy.lm)
    trajs = _own_logprobs(policy, make_trajectories(384))
    run_tokens = sum(s.output_ids.numpy().size for t in trajs for s in t.samples if t.group_id != 3)  # 3: skipped
    for n_mini in (1, 2):
        m = _lr0_step(tiny_model_dir, trajs, AlgoConfig(ppo_minibatches=n_mini), version=0, batch_invariant=True,
                      share_prefixes=False)
        assert m["train/logprob_diff_tokens"] == run_tokens == m["train/mismatch/tokens"], n_mini
        assert m["train/logprob_diff_max"] == 0.0 and m["train/logprob_diff_mean"] == 0.0, n_mini
        assert m["train/mismatch/kl"] == 0.0 and m["train/mismatch/chi2_token"] == 0.0, n_mini
        assert m["train/mismatch/ess"] == 1.0 and m["train/mismatch/ppl_ratio"] == 1.0, n_mini
    other = _lr0_step(tiny_model_dir, trajs, AlgoConfig(), version=1, batch_invariant=True, share_prefixes=False)
    assert other["train/logprob_diff_tokens"] == 0 and "train/logprob_diff_max" not in other
    assert other["train/mismatch/tokens"] == run_tokens

    s = trajs[0].samples[0]
    trajs[0].samples[0] = msgspec.structs.replace(
        s, behav_logprobs=Array.of(s.behav_logprobs.numpy() - 0.25, "float32"),
        versions=Array.of(np.ones(s.output_ids.numpy().size), "int32"))
    m = _lr0_step(tiny_model_dir, trajs, AlgoConfig(), version=0, batch_invariant=True, share_prefixes=False)
    stale = s.output_ids.numpy().size
    assert m["train/logprob_diff_tokens"] == run_tokens - stale and m["train/logprob_diff_max"] == 0.0
    assert m["train/mismatch/tokens"] == run_tokens
    assert m["train/mismatch/kl"] == pytest.approx(-0.25 * stale / run_tokens, rel=1e-5)  # E[behav − train]
    # shared-prefix packing (TreeBatch, sequences bounded by its cu_seqlens in the unshared layout):
    # the same sequences and values up to the tree attention's rounding
    tree = _lr0_step(tiny_model_dir, trajs, AlgoConfig(), version=0, batch_invariant=True)
    assert tree["train/mismatch/seqs"] == m["train/mismatch/seqs"] == 5  # 8 samples: group 3, one empty response
    assert tree["train/logprob_diff_max"] < 1e-5
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "ess", "ppl_ratio", "log_ppl_diff_min", "training_ppl"):
        assert tree[f"train/mismatch/{k}"] == pytest.approx(m[f"train/mismatch/{k}"], rel=1e-4, abs=1e-6), k
    # naive PPO with 2 minibatches runs no proximal pass: only the first minibatch's forward (before
    # any update) is at version 0; groups 0–1 run, minus the stale sample
    naive = _lr0_step(tiny_model_dir, trajs, AlgoConfig(ppo_minibatches=2, objective="naive"), version=0,
                      batch_invariant=True, share_prefixes=False)
    first = sum(x.output_ids.numpy().size for t in trajs[:2] for x in t.samples)
    assert naive["train/mismatch/tokens"] == first and naive["train/logprob_diff_tokens"] == first - stale
    assert naive["train/logprob_diff_max"] == 0.0
