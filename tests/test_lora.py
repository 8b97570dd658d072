"""LoRA (``trainer.lora``, ``areal_async/trainer/lora.py``): the packed and tree paths against peft's
own model, what is trained and in which dtype, LoRA off unchanged, determinism, FSDP2/DDP ranks,
and the weight-sync API's names.

Tolerances: fp32 on CPU, the packed/tree forward against a padded HF forward differ only in
summation order (attention over other lengths): 1e-5 absolute on log-probs (≈ -6), 1e-5
relative to the largest gradient entry on adapter gradients.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from areal_async.config import AlgoConfig, LoraConfig, TrainerConfig
from tests.support.batches import make_trajectories, shared_prefix_trajectories

CPU = torch.device("cpu")


def _cfg(rank: int = 4, **kwargs) -> TrainerConfig:
    lora = {k: kwargs.pop(k) for k in ("alpha", "dropout", "target_modules") if k in kwargs}
    kwargs.setdefault("parallel", "ddp")  # no process group: the bare PackedPolicy
    return TrainerConfig(lora=LoraConfig(rank=rank, **lora), **kwargs)


def _policy(model_dir, batch_invariant: bool = False, **kwargs):
    from areal_async.trainer.policy import build_policy

    torch.manual_seed(0)
    return build_policy(str(model_dir), _cfg(**kwargs), CPU, batch_invariant=batch_invariant)


def _randomize_adapters(policy, seed: int = 1) -> None:
    """Adapters away from peft's init (B = 0 would make the adapted model the base)."""
    from areal_async.trainer.lora import is_adapter_name

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.lm.named_parameters():
            if is_adapter_name(name):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _peft_reference(model_dir, policy):
    """peft's own ``PeftModel`` of the base (eager attention, fp32) with ``policy``'s adapters,
    loaded by the names ``adapter_parameters`` gives."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.lora import adapter_config, adapter_state_dict, make_peft_config

    cfg = adapter_config(policy)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref = get_peft_model(base, make_peft_config(LoraConfig(rank=cfg["r"], alpha=cfg["lora_alpha"]),
                                                cfg["target_modules"], str(model_dir)))
    result = set_peft_model_state_dict(ref, adapter_state_dict(policy))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return ref


def _padded_logprobs(ref, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Next-token log-probs of each sequence ``[len - 1]`` from one right-padded HF forward."""
    n = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
    logp = torch.log_softmax(ref(input_ids=ids, attention_mask=mask).logits.float(), -1)
    return [logp[b, : len(s) - 1].gather(-1, ids[b, 1 : len(s), None])[:, 0] for b, s in enumerate(seqs)]


def _seqs(vocab: int, shared: bool) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    pre = torch.randint(3, vocab, (9,), generator=gen).tolist() if shared else []
    return [pre + torch.randint(3, vocab, (k,), generator=gen).tolist() for k in (5, 11, 3, 8)]


def _adapter_grads(named) -> dict[str, torch.Tensor]:
    from areal_async.trainer.lora import PEFT_PREFIX, peft_name

    out = {}
    for name, p in named:
        if "lora_" in name and p.grad is not None:
            key = name.removeprefix(PEFT_PREFIX)  # the reference's names carry the prefix already
            out[peft_name(key)] = p.grad.clone()
    return out


@pytest.mark.parametrize("tree", [False, True], ids=["packed", "tree"])
def test_lora_forward_and_backward_match_peft(tiny_model_dir, tree):
    from areal_async.trainer.packing import pack_sequences
    from areal_async.trainer.tree import pack_tree

    torch.set_num_threads(1)
    policy = _policy(tiny_model_dir, alpha=6.0)
    _randomize_adapters(policy)
    ref = _peft_reference(tiny_model_dir, policy)
    seqs = _seqs(policy.lm.config.vocab_size, shared=tree)
    batch = pack_tree(seqs, attention="sdpa") if tree else pack_sequences(seqs)
    if tree:
        assert batch.input_ids.numel() < sum(map(len, seqs))  # the preamble is forwarded once
    logp, _ = policy(batch)
    want = _padded_logprobs(ref, seqs)
    starts = [0] + torch.cumsum(torch.tensor([len(s) for s in seqs]), 0).tolist()
    got = [logp[a : b - 1] for a, b in zip(starts, starts[1:])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    weights = torch.linspace(-1.0, 1.0, logp.numel())  # any loss that weighs every token differently
    (logp * weights).sum().backward()
    flat_w = torch.cat([weights[a : b - 1] for a, b in zip(starts, starts[1:])])
    (torch.cat(want) * flat_w).sum().backward()
    ours, theirs = _adapter_grads(policy.lm.named_parameters()), _adapter_grads(ref.named_parameters())
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    scale = max(t.abs().max() for t in theirs.values())
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-5 * float(scale), rtol=0, msg=k)
    # nothing but the adapters gets a gradient
    assert all(p.grad is None for n, p in policy.lm.named_parameters() if "lora_" not in n)


def test_only_adapters_are_trained_and_the_base_stays_frozen_in_the_compute_dtype(tiny_model_dir):
    from areal_async.trainer.lora import is_adapter_name
    from areal_async.trainer.policy import trainable_parameters
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _policy(tiny_model_dir, dtype="bfloat16", max_tokens_per_mb=24)
    lm = policy.lm
    base = {n: p.detach().clone() for n, p in lm.named_parameters() if not is_adapter_name(n)}
    adapters = {n: p.detach().clone() for n, p in lm.named_parameters() if is_adapter_name(n)}
    assert adapters and all(p.dtype == torch.bfloat16 and not p.requires_grad
                            for n, p in lm.named_parameters() if n in base)
    assert all(p.dtype == torch.float32 and p.requires_grad for n, p in lm.named_parameters() if n in adapters)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # still tied, once cast
    assert not any("lm_head" in n or "embed" in n for n in adapters)
    params = trainable_parameters(policy)
    assert len(params) == len(adapters)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    cfg = _cfg(dtype="bfloat16", max_tokens_per_mb=24)
    train_step(policy, optimizer, make_trajectories(lm.config.vocab_size), AlgoConfig(), cfg, 1.0, CPU, version=0)
    after = dict(lm.named_parameters())
    assert all(torch.equal(after[n], t) and after[n].dtype == torch.bfloat16 for n, t in base.items())
    assert any(not torch.equal(after[n], t) for n, t in adapters.items())
    assert {id(p) for p in optimizer.state} == {id(p) for p in params}  # AdamW state for the adapters only
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())


def test_lora_off_builds_the_full_model_unchanged(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.lora import lora_enabled
    from areal_async.trainer.policy import build_policy, full_parameters, trainable_parameters

    assert TrainerConfig().lora.rank == 0  # off by default
    policy = build_policy(str(tiny_model_dir), TrainerConfig(parallel="ddp"), CPU)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not lora_enabled(policy)
    ours = dict(policy.lm.named_parameters())
    assert list(ours) == [n for n, _ in hf.named_parameters()]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in ours.values())
    assert all(torch.equal(ours[n], p) for n, p in hf.named_parameters())
    assert [id(p) for p in trainable_parameters(policy)] == [id(p) for p in policy.parameters()]
    assert [n for n, _ in full_parameters(policy)] == list(ours)
    assert not any(type(m).__module__.startswith("peft") for m in policy.modules())


def test_a_bad_target_module_names_the_linear_layers_found(tiny_model_dir):
    with pytest.raises(ValueError, match=r"\['qq_proj'\] is no linear layer.*'q_proj', 'k_proj', 'v_proj', "
                                         r"'o_proj', 'gate_proj', 'up_proj', 'down_proj'"):
        _policy(tiny_model_dir, target_modules=("q_proj", "qq_proj"))
    with pytest.raises(ValueError, match="lm_head"):
        _policy(tiny_model_dir, target_modules=("lm_head",))


def test_all_linear_in_a_list_is_refused_naming_the_fix():
    # target_modules=[all-linear] used to pass the config and fail at launch with "['all-linear'] is
    # no linear layer ...; give some of those, or 'all-linear' for all"
    from areal_async.config import load_config

    for given in ("[all-linear]", "[all-linear,q_proj]"):
        with pytest.raises(ValueError, match=r"'all-linear' stands alone.*trainer.lora.target_modules=all-linear"):
            load_config(None, ["trainer.lora.rank=4", f"trainer.lora.target_modules={given}"])


def test_a_rank_above_every_targeted_layer_s_width_is_refused(tiny_model_dir):
    # trainer.lora.rank=100000 on SmolLM2-135M used to pass every check: 3e10 adapter parameters
    # (122 GB in fp32) before AdamW, where B·A cannot have a rank above 576 (its hidden size)
    from areal_async.trainer.lora import check_lora_settings

    check_lora_settings(str(tiny_model_dir), LoraConfig(rank=64))  # hidden 64: q_proj is 64 × 64
    with pytest.raises(ValueError, match=r"trainer.lora.rank=65 .* at most 64 .*trainer.lora.rank=64 or less"):
        check_lora_settings(str(tiny_model_dir), LoraConfig(rank=65))
    with pytest.raises(ValueError, match=r"trainer.lora.rank=33 .* at most 32 "):  # k_proj: 64 -> 2 KV heads × 16
        check_lora_settings(str(tiny_model_dir), LoraConfig(rank=33, target_modules=("k_proj",)))
    with pytest.raises(ValueError, match=r"trainer.lora.rank=100000"):
        _policy(tiny_model_dir, rank=100000)


def test_lora_with_compile_is_refused(tiny_model_dir):
    from areal_async.config import load_config

    with pytest.raises(ValueError, match="trainer.compile"):
        load_config(None, ["trainer.lora.rank=4", "trainer.compile=true"])
    with pytest.raises(ValueError, match="trainer.compile"):
        _policy(tiny_model_dir, compile=True)


def test_target_modules_subset_and_alpha_default(tiny_model_dir):
    from areal_async.trainer.lora import adapter_config, adapter_parameters

    policy = _policy(tiny_model_dir, rank=2, target_modules=("v_proj", "q_proj"))
    cfg = adapter_config(policy)
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 4.0 and cfg["peft_type"] == "LORA"
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["base_model_name_or_path"] == str(tiny_model_dir)
    names = [n for n, _ in adapter_parameters(policy)]
    assert names[:4] == [f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight"
                         for m in ("q_proj", "v_proj") for ab in "AB"]
    assert len(names) == 8


def test_batch_invariant_linears_reach_the_base_and_adapter_linears(tiny_model_dir):
    from peft.tuners.lora import LoraLayer

    policy = _policy(tiny_model_dir, batch_invariant=True)
    layers = [m for m in policy.lm.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 14
    for m in layers:
        assert isinstance(m.base_layer, torch.nn.Linear) and "forward" in vars(m.base_layer)
        assert "forward" in vars(m.lora_A["default"]) and "forward" in vars(m.lora_B["default"])


def _det_step(model_dir, trajs, **kwargs) -> dict[str, torch.Tensor]:
    from areal_async.trainer.lora import adapter_state_dict
    from areal_async.trainer.policy import trainable_parameters
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    policy = _policy(model_dir, batch_invariant=True, max_tokens_per_mb=24, **kwargs)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-3)
    cfg = _cfg(max_tokens_per_mb=24, **kwargs)
    for _ in range(2):
        train_step(policy, optimizer, trajs, AlgoConfig(ppo_minibatches=2), cfg, 1.0, CPU, version=0)
    return adapter_state_dict(policy)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_deterministic_lora_step_is_bit_identical_when_repeated(tiny_model_dir, dropout):
    vocab = 384
    trajs = shared_prefix_trajectories(vocab)  # the tree path (share_prefixes, the default)
    one = _det_step(tiny_model_dir, trajs, dropout=dropout)
    two = _det_step(tiny_model_dir, trajs, dropout=dropout)
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)
    b = [k for k in one if "lora_B" in k]
    assert any(one[k].abs().max() > 0 for k in b)  # trained away from B = 0


def test_lora_dropout_drops_only_in_gradient_passes(tiny_model_dir):
    from areal_async.trainer.packing import pack_sequences

    policy = _policy(tiny_model_dir, dropout=0.5)
    _randomize_adapters(policy)
    batch = pack_sequences(_seqs(policy.lm.config.vocab_size, shared=False))
    with torch.no_grad():
        a, b = policy(batch)[0], policy(batch)[0]
    assert torch.equal(a, b)
    assert not torch.equal(policy(batch)[0].detach(), a)  # with grad: dropped


# -- FSDP2 / DDP ranks ------------------------------------------------------------------------------

def _run_rank(rank: int, world: int, rendezvous: str, model_dir: str, out_path: str, parallel: str,
              dtype: str) -> None:
    import faulthandler

    import torch.distributed as dist

    from areal_async.trainer.lora import adapter_parameters, adapter_state_dict

    faulthandler.enable()  # a crash in a rank prints its Python stack to the test's output
    from areal_async.trainer.policy import build_policy, full_state_dict, trainable_parameters
    from areal_async.trainer.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        cfg = _cfg(max_tokens_per_mb=24, grad_clip=1e6, parallel=parallel, dtype=dtype)
        torch.manual_seed(0)
        policy = build_policy(model_dir, cfg, CPU)
        optimizer = torch.optim.SGD(trainable_parameters(policy), lr=0.5)
        trajs = shared_prefix_trajectories(384)
        for _ in range(2):
            metrics = train_step(policy, optimizer, trajs, AlgoConfig(), cfg, 1.0, CPU, version=0)
        adapters = adapter_state_dict(policy)
        names = [n for n, t in adapter_parameters(policy) if (t is None) == (rank != 0)]
        merged = full_state_dict(policy)
        if rank == 0:
            torch.save({"adapters": adapters, "names": names, "merged": merged, "metrics": metrics}, out_path)
        dist.barrier()  # no rank tears the group down while another still uses it, as trainer/main.py does
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(world: int, model_dir, tmp_path, parallel: str, dtype: str = "float32") -> dict:
    out = tmp_path / f"lora-{world}-{parallel}-{dtype}.pt"
    mp.start_processes(_run_rank, args=(world, str(tmp_path / f"rdv-{out.stem}"), str(model_dir), str(out), parallel,
                                        dtype), nprocs=world, join=True, start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("parallel", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_ranks_train_the_same_adapters_as_one(tiny_model_dir, tmp_path, parallel):
    one = _train(1, tiny_model_dir, tmp_path, "fsdp2")
    two = _train(2, tiny_model_dir, tmp_path, parallel)
    assert one["names"] == two["names"] == list(one["adapters"]) and len(one["names"]) == 28
    for k, t in one["adapters"].items():
        torch.testing.assert_close(two["adapters"][k], t, atol=1e-6, rtol=0, msg=k)
    assert any(t.abs().max() > 0 for k, t in two["adapters"].items() if "lora_B" in k)
    # full_parameters (what the weight sync sends) gives the HF names, merged
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert list(two["merged"]) == list(one["merged"]) and set(two["merged"]) == set(base)  # tied head: once
    assert not torch.equal(two["merged"]["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow
def test_fsdp2_with_a_bf16_base_and_fp32_adapters(tiny_model_dir, tmp_path):
    one = _train(1, tiny_model_dir, tmp_path, "fsdp2", "bfloat16")
    two = _train(2, tiny_model_dir, tmp_path, "fsdp2", "bfloat16")
    assert all(t.dtype == torch.float32 for t in two["adapters"].values())
    for k, t in one["adapters"].items():  # bf16 compute: reduction order differs between the runs
        torch.testing.assert_close(two["adapters"][k], t, atol=2e-2, rtol=0, msg=k)
