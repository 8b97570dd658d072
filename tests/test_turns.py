"""Trajectories that carry turns: an episode's per-token fields through the plan, the loss, the trees
and the queue's staleness accounting.

The hand-built episode (``EP0``): prompt ``P`` (4 tokens), sampled turn 1 (2 tokens, version 3),
a tool result (3 tokens, never sampled), sampled turn 2 (2 tokens, version 2). Its sequence is
``P + output_ids`` (11 tokens); output token ``j`` is predicted at position ``4 - 1 + j``, so the
loss positions are 3, 4 (turn 1) and 8, 9 (turn 2), and the tool tokens' positions 5, 6, 7 are
not. Rewards: group 0 is EP0 (+5, turn rewards [3, 3]) and EP1 (−5, [1, 1]); EP1 repeats EP0's
first turn and tool result and then samples another turn 2 (so the two share 9 tokens).
Derivations are in the comments; tolerances are torch's defaults unless stated.
"""

from __future__ import annotations


import msgspec
import numpy as np
import pytest
import torch

from areal_async.algo.advantages import turn_advantages
from areal_async.algo.loss import decoupled_ppo_loss
from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.contract import ContractViolation, check_batch
from areal_async.trainer.plan import build_sequences, make_plan
from areal_async.trainer.report import batch_metrics
from areal_async.trainer.tree import TreeBatch
from areal_async.types import Array, Sample, Trajectory, sample_seed
from tests.support.episodes import P, TOOL, episode, ep0, ep1, group0, restarted_group, through_the_queue

def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# Episode advantages: GRPO over {+5, −5}: mean 0, population std 5 → ±5 / (5 + 1e-6), in float32.
A_EP = f32(5.0) / (f32(5.0) + 1e-6)
# Turn rewards of group 0: {3, 3, 1, 1}, mean 2, population std 1 → r̃ = ±1 / (1 + 1e-6);
# reward to go: EP0 turn 1 gets r̃ + r̃ = 2 / (1 + 1e-6), turn 2 gets 1 / (1 + 1e-6); EP1 the negatives.
R1 = f32(1.0) / (f32(1.0) + 1e-6)


def test_turn_advantages_hand_derived():
    # Samples 0, 1 (group 0) and 2, 3 (group 1), group size 2. Group 0's turns {1, 3, 3 | 1}: mean
    # 2, population std 1 → r̃ = [-1, 1, 1 | -1] / (1 + 1e-6); to go within each sample:
    # sample 0 [-1 + 1 + 1, 1 + 1, 1] = [1, 2, 1], sample 1 [-1]. Group 1 all equal ({4, 4, 4}): 0.
    rewards = torch.tensor([1.0, 3.0, 3.0, 1.0, 4.0, 4.0, 4.0])
    owner = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    got = turn_advantages(rewards, owner, group_size=2)
    want = torch.stack([R1, 2 * R1, R1, -R1, f32(0), f32(0), f32(0)])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[4:], torch.zeros(3))  # exactly 0, never a rounding residue


def test_turn_rewards_are_summed_into_the_episode_return_by_default():
    # algo.turn_rewards = "sum": returns 5 + 3 + 3 = 11 and −5 + 1 + 1 = −3; mean 4, population
    # std 7 → ±7 / (7 + 1e-6) on every sampled token of each episode, 0 elsewhere.
    seqs = build_sequences([group0()], AlgoConfig())
    a = f32(7.0) / (f32(7.0) + 1e-6)
    for s, sign in zip(seqs, (1, -1)):
        torch.testing.assert_close(s.advantages, torch.where(s.loss_mask, sign * a, 0.0), rtol=0, atol=0)
    assert seqs[0].loss_mask.nonzero()[:, 0].tolist() == [3, 4, 8, 9]
    # rollout/reward reports the same returns (it was the reward alone: 0 for every Env episode)
    assert [s.episode_return() for s in group0().samples] == [11.0, -3.0]
    assert batch_metrics([group0()], step=5, step_s=1.0)["rollout/reward"] == 4.0


def test_sampled_tokens_carry_the_loss_fields():
    seqs = build_sequences([group0()], AlgoConfig(turn_rewards="reward_to_go"))
    s = seqs[0]
    assert s.ids == P + [21, 22] + TOOL + [23, 24]
    assert s.loss_mask.nonzero()[:, 0].tolist() == [3, 4, 8, 9]  # not 5, 6, 7: the tool's tokens
    assert s.behav_logprobs.tolist() == [0, 0, 0, -1, -2, 0, 0, 0, -3, -4, 0]
    # per-turn rewards reach their turns: turn 1 A + 2r̃, turn 2 A + r̃ (module docstring)
    want = torch.zeros(11)
    want[[3, 4]], want[[8, 9]] = A_EP + 2 * R1, A_EP + R1
    torch.testing.assert_close(s.advantages, want)
    # EP1: turn 1 is output tokens 0, 1 → positions 3, 4; its turn 2 output tokens 5-7 → positions 8-10
    want1 = torch.zeros(12)
    want1[[3, 4]], want1[[8, 9, 10]] = -A_EP - 2 * R1, -A_EP - R1
    assert seqs[1].loss_mask.nonzero()[:, 0].tolist() == [3, 4, 8, 9, 10]
    torch.testing.assert_close(seqs[1].advantages, want1)


def test_versions_and_staleness_count_from_the_oldest_sampled_token():
    s = ep0()
    assert s.versions.tolist() == [3, 3, -1, -1, -1, 2, 2]  # −1 where not sampled
    assert s.oldest_version() == 2  # turn 2 (version 2) is older than the first token's version 3
    # Through the queue: msgpack frame → in-process queue → batch → staleness at step 5.
    # EP0: 5 − 2 = 3 (the first token's version would give 2); EP1: 5 − 3 = 2.
    batch = through_the_queue(group0())
    assert batch == [group0()]
    m = batch_metrics(batch, step=5, step_s=1.0)
    assert m["staleness/hist"] == [3.0, 2.0]
    assert m["rollout/multi_version_frac"] == 0.5  # EP0 spans {2, 3}; −1 is not a version
    assert m["rollout/response_len"] == (4 + 5) / 2  # sampled tokens per sample


def test_the_contract_reads_the_versions_of_sampled_tokens_only():
    # Deterministic batch 0 of B = 1, η = 0: v(0) = 0. Tool tokens carry −1 and pass; a sampled
    # token of version 1 is a violation.
    def batch(v_turn2):
        samples = [msgspec.structs.replace(episode(i, [([21], [-1.0], 0), (TOOL,), ([22], [-1.0], v_turn2)], 0.0),
                                           seed=sample_seed(7, 0, i)) for i in range(2)]
        return [Trajectory(group_id=0, prompt_ids=Array.of(P, "int32"), samples=samples, data_index=0)]

    check_batch(batch(0), step=0, batch_size=1, max_staleness=0, run_seed=7, n_samples=2)
    with pytest.raises(ContractViolation, match="versions"):
        check_batch(batch(1), step=0, batch_size=1, max_staleness=0, run_seed=7, n_samples=2)


def test_unsampled_tokens_never_reach_the_loss():
    # A log-prob or version on a token the model did not sample means a mask misaligned with the
    # tokens: refused, naming the token (output token 2, the tool result's first).
    for garbage in (float("nan"), float("inf"), 50.0):
        with pytest.raises(ValueError, match="sample 0: token 2 is not sampled"):
            build_sequences([group0(tool_logprob=garbage)], AlgoConfig())
    with pytest.raises(ValueError, match="token 2 is not sampled .* version 9"):
        build_sequences([group0(tool_version=9)], AlgoConfig())
    clean = build_sequences([group0()], AlgoConfig())[0]
    # At the loss: perturbed behaviour log-probs and advantages at the tool positions give the same
    # loss and gradient, and the tool positions get gradient exactly 0.
    theta = (-torch.rand(11, generator=torch.Generator().manual_seed(0)) - 1.0).requires_grad_()
    loss, _ = decoupled_ppo_loss(theta, theta.detach() + 0.05, clean.behav_logprobs, clean.advantages, clean.loss_mask)
    (grad,) = torch.autograd.grad(loss, theta)
    off = ~clean.loss_mask
    behav = clean.behav_logprobs.masked_fill(off, float("-inf"))
    adv = clean.advantages.masked_fill(off, 1e6)
    loss2, _ = decoupled_ppo_loss(theta, theta.detach() + 0.05, behav, adv, clean.loss_mask)
    (grad2,) = torch.autograd.grad(loss2, theta)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert torch.equal(grad[off], torch.zeros(int(off.sum()))) and bool((grad[~off] != 0).all())


def test_explicit_all_ones_mask_is_the_single_response():
    # A response given with loss_mask all ones is the single-turn sample, bit for bit.
    single = restarted_group().samples[0]
    ones = msgspec.structs.replace(single, loss_mask=Array.of([1, 1, 1], "uint8"))
    a, b = (build_sequences([msgspec.structs.replace(restarted_group(), samples=[s, restarted_group().samples[1]])],
                            AlgoConfig())[0] for s in (single, ones))
    assert a.ids == b.ids and all(torch.equal(getattr(a, f), getattr(b, f))
                                  for f in ("behav_logprobs", "advantages", "loss_mask"))
    # On the wire a single response carries none of the episode fields (defaults are omitted).
    frame = msgspec.msgpack.encode(single)
    assert not any(k in frame for k in (b"loss_mask", b"turn_spans", b"turn_rewards"))
    assert msgspec.msgpack.decode(frame, type=Sample) == single


def test_bad_turn_fields_name_the_sample():
    bad = msgspec.structs.replace(ep0(), turn_spans=Array.of([[0, 2], [6, 7]], "int32"))  # token 5 uncovered
    with pytest.raises(ValueError, match="group 0: sample 0: sampled token 5 lies in no turn"):
        build_sequences([msgspec.structs.replace(group0(), samples=[bad, ep1()])], AlgoConfig())
    short = msgspec.structs.replace(ep0(), loss_mask=Array.of([1, 1], "uint8"))
    with pytest.raises(ValueError, match="loss_mask has shape"):
        short.check()


# The batch [group0(), restarted_group()] by hand, with algo.turn_rewards = "reward_to_go": per
# sequence its ids, loss positions, behaviour log-probs and advantages there (group 1 has no turn
# rewards: ±A on every sampled token).
HAND = [
    (P + [21, 22] + TOOL + [23, 24], [3, 4, 8, 9], [-1.0, -2.0, -3.0, -4.0],
     [A_EP + 2 * R1] * 2 + [A_EP + R1] * 2),
    (P + [21, 22] + TOOL + [26, 27, 28], [3, 4, 8, 9, 10], [-1.5, -2.5, -0.5, -0.25, -0.125],
     [-A_EP - 2 * R1] * 2 + [-A_EP - R1] * 3),
    (P + [21, 22, 41], [3, 4, 5], [-1.0, -1.0, -2.0], [A_EP] * 3),
    (P + [21, 22] + TOOL + [25], [8], [-0.75], [-A_EP]),
]


def _reference(model_dir) -> tuple[torch.Tensor, dict]:
    """Loss and gradients from a plain HF forward of each sequence alone: the decoupled-PPO loss at
    π_prox = π_θ (r = 1, so the clip is inactive): Σ_t −w_t A_t r_t / N over the loss positions only,
    w_t = exp(log π_θ − behav) detached, N = 13 loss tokens (EP0 4 + EP1 5 + 3 + 1)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for ids, pos, behav, adv in HAND:
        logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0], dim=-1)
        lp = logp[pos, [ids[p + 1] for p in pos]]
        w = torch.exp(lp.detach() - torch.tensor(behav))
        total = total + (-w * torch.stack(adv) * torch.exp(lp - lp.detach())).sum()
    loss = total / 13
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lm.named_parameters()}


def _plan_loss(model_dir, share: bool) -> tuple[torch.Tensor, dict, list]:
    """The trainer's path: plan → packed (or tree) micro-batches → packed log-probs → loss."""
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.attention import use_packed_attention
    from areal_async.trainer.packed_policy import PackedPolicy, packed_logprobs

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_attention(lm)
    policy = PackedPolicy(lm)
    plan = make_plan([group0(), restarted_group()], AlgoConfig(behav_imp_weight_cap=None, turn_rewards="reward_to_go"),
                     TrainerConfig(share_prefixes=share, skip_zero_advantage=False), "cpu")
    (mb,) = plan.minibatches
    assert mb.loss_tokens == 13
    total, batches = torch.zeros(()), list(mb.micro_batches())
    for batch in batches:
        theta, _ = packed_logprobs(policy, batch, 1.0)
        loss, _ = decoupled_ppo_loss(theta, theta.detach(), batch.behav_logprobs, batch.advantages, batch.loss_mask,
                                     num_tokens=mb.loss_tokens)
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in lm.named_parameters()}, batches


def test_loss_and_gradients_equal_the_per_sequence_reference(tiny_model_dir, one_torch_thread):
    # Unshared packing and trees against each sequence alone through HF's attention: fp32, the
    # packings differ from it only in summation order (loss rtol 1e-5; gradients atol 1e-6 on
    # entries of ~1e-3). Training on the tool tokens too, or dividing by all output tokens (21),
    # is off by far more.
    ref_loss, ref_grads = _reference(tiny_model_dir)
    for share in (False, True):
        loss, grads, batches = _plan_loss(tiny_model_dir, share)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_trees_share_the_prompt_and_earlier_turns(tiny_model_dir, one_torch_thread):
    # One tree of 16 nodes for 40 tokens: sorted EP0, restarted, EP1, single, with common prefixes
    # 9 (prompt + turn 1 + tool), 9, 6 (prompt + turn 1): 40 − 24 = 16. The restarted sample's
    # turn 1 (loss mask 0 there) is the same nodes as EP0's (mask 1): the loss rows follow each
    # sequence's own mask, so the head reads those nodes for EP0, EP1 and single, not for it.
    _, _, (tree,) = _plan_loss(tiny_model_dir, True)[:3]
    assert isinstance(tree, TreeBatch) and tree.input_ids.numel() == 16 and tree.num_seq_tokens == 40
    assert tree.head_index.tolist() == tree.loss_mask.nonzero()[:, 0].tolist()
    offsets = np.cumsum([0] + [len(ids) for ids, *_ in HAND])
    assert tree.head_index.tolist() == [o + p for o, (_, pos, *_) in zip(offsets, HAND) for p in pos]
    flat = [t for ids, *_ in HAND for t in ids]
    assert tree.head_labels.tolist() == [flat[i + 1] for i in tree.head_index.tolist()]
