"""``trainer.activation_checkpointing`` (``trainer/policy.py``): the same log-probs and gradients as
without it, on the packed and tree paths, for full fine-tuning and LoRA (dropout masks replayed),
with far fewer bytes kept for the backward pass."""

from __future__ import annotations

import pytest
import torch

from areal_async.config import LoraConfig, TrainerConfig

CPU = torch.device("cpu")


def _policy(model_dir, checkpointing: bool, rank: int, dropout: float = 0.0):
    from areal_async.trainer.policy import build_policy

    torch.manual_seed(0)
    cfg = TrainerConfig(parallel="ddp", activation_checkpointing=checkpointing,
                        lora=LoraConfig(rank=rank, dropout=dropout))
    policy = build_policy(str(model_dir), cfg, CPU)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters away from B = 0, the same in both policies
        for name, p in policy.lm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return policy


def _batch(vocab: int, tree: bool):
    from areal_async.trainer.packing import pack_sequences
    from areal_async.trainer.tree import pack_tree

    gen = torch.Generator().manual_seed(3)
    pre = torch.randint(3, vocab, (9,), generator=gen).tolist()
    seqs = [pre + torch.randint(3, vocab, (k,), generator=gen).tolist() for k in (5, 11, 3, 8)]
    return pack_tree(seqs, attention="sdpa") if tree else pack_sequences(seqs)


def _run(policy, batch):
    """Log-probs, gradients by name, and the bytes autograd kept for the backward pass."""
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(7)  # LoRA dropout draws its masks here
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = policy(batch)
    (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.lm.named_parameters() if p.grad is not None}
    return logp.detach(), grads, sum(kept)


@pytest.mark.parametrize("rank,dropout", [(0, 0.0), (4, 0.0), (4, 0.3)], ids=["full", "lora", "lora-dropout"])
@pytest.mark.parametrize("tree", [False, True], ids=["packed", "tree"])
def test_checkpointing_keeps_logprobs_and_gradients_and_saves_memory(tiny_model_dir, tree, rank, dropout):
    torch.set_num_threads(1)
    plain = _policy(tiny_model_dir, False, rank, dropout)
    batch = _batch(plain.lm.config.vocab_size, tree)
    logp, grads, kept = _run(plain, batch)
    ckpt = _policy(tiny_model_dir, True, rank, dropout)
    logp_c, grads_c, kept_c = _run(ckpt, batch)
    assert torch.equal(logp, logp_c)
    assert grads and grads.keys() == grads_c.keys()
    assert all(("lora_" in n) == bool(rank) for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert kept_c < 0.5 * kept, (kept_c, kept)


def test_checkpointing_is_off_by_default_and_skipped_without_grad(tiny_model_dir):
    assert TrainerConfig().activation_checkpointing is False
    ckpt = _policy(tiny_model_dir, True, 0)
    batch = _batch(ckpt.lm.config.vocab_size, False)
    with torch.no_grad():  # the proximal / behaviour passes: a plain forward, nothing recomputed
        got, _ = ckpt(batch)
    with torch.no_grad():
        want, _ = _policy(tiny_model_dir, False, 0)(batch)
    assert torch.equal(got, want)
