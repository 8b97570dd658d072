"""Episodes with several training sequences (``Sample.segments``): packing, advantages, checks,
staleness, the wire and the determinism contract.

The hand-built group (``seg_group``): prompt ``P`` (4 tokens), two episodes.
- ES (sample 0, reward +5) has three sequences:
  first ``P + [21 22] TOOL [23 24]``: turns at output 0-1 and 5-6 (version 3) → loss positions 3, 4, 8, 9;
  segment 0 ``Q0 + [51 52] [33] [53]`` (``Q0`` 8 tokens): turns at output 0-1 (version 2, the
  episode's oldest) and 3 (version 3) → loss positions 7, 8, 10;
  segment 1 ``Q1 + [61 62 63]`` (``Q1`` 3 tokens), one turn, every token sampled → positions 2, 3, 4.
  Turn rewards, all 5 turns in order: [3, 1, 1, 3, 3].
- EF (sample 1, reward −5): one sequence ``P + [21 22] TOOL [26] TOOL [27 28]``, three turns,
  turn rewards [1, 3, 1].
Derivations are in the comments.
"""

from __future__ import annotations

import hashlib
import io
import json

import msgspec
import pytest
import torch

from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.contract import ContractViolation, check_batch, dump_batch
from areal_async.trainer.plan import build_sequences, make_plan
from areal_async.trainer.report import batch_metrics
from areal_async.types import Array, Sample, Trajectory, sample_seed
from tests.support.batches import make_trajectories, shared_prefix_trajectories
from tests.support.episodes import P, TOOL, episode, group0, restarted_group, segment, through_the_queue

Q0 = P + [21, 22, 91, 92]
Q1 = [11, 12, 99]


def es(seg1_turns: bool = True, **kw) -> Sample:
    first = episode(0, [([21, 22], [-1.0, -2.0], 3), (TOOL,), ([23, 24], [-3.0, -4.0], 3)], 5.0,
                    [3.0, 1.0, 1.0, 3.0, 3.0], **kw)
    seg0 = segment(Q0, [([51, 52], [-0.5, -0.25], 2), ([33],), ([53], [-0.125], 3)])
    seg1 = msgspec.structs.replace(segment(Q1, [([61, 62, 63], [-1.5, -2.5, -3.5], 3)], turns=seg1_turns),
                                   loss_mask=None)
    return msgspec.structs.replace(first, segments=[seg0, seg1])


def ef() -> Sample:
    parts = [([21, 22], [-1.5, -2.5], 3), (TOOL,), ([26], [-0.5], 3), (TOOL,), ([27, 28], [-0.25, -0.125], 3)]
    return episode(1, parts, -5.0, [1.0, 3.0, 1.0])


def seg_group(sample0: Sample | None = None) -> Trajectory:
    return Trajectory(group_id=0, prompt_ids=Array.of(P, "int32"), samples=[sample0 or es(), ef()], data_index=0)


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# Turn rewards of the group {3, 1, 1, 3, 3 | 1, 3, 1}: mean 2, population std 1 → r̃ = ±R1.
R1 = f32(1.0) / (f32(1.0) + 1e-6)
# Reward to go within each episode (sums from the last turn back, exact in float32):
# ES [+, −, −, +, +] → [R1, 0, R1, 2R1, R1]; EF [−, +, −] → [−R1, 0, −R1].
ES_TO_GO = [R1, f32(0.0), R1, 2 * R1, R1]
EF_TO_GO = [-R1, f32(0.0), -R1]
# Episode advantages with reward to go: GRPO over {+5, −5} → ±5 / (5 + 1e-6).
A_EP = f32(5.0) / (f32(5.0) + 1e-6)
# With the default "sum": returns 5 + 11 = 16 and −5 + 5 = 0: mean 8, std 8 → ±8 / (8 + 1e-6).
A_SUM = f32(8.0) / (f32(8.0) + 1e-6)

# Per sequence of the group in build order: ids, loss positions, behaviour log-probs there, and the
# turn index (into ES_TO_GO / EF_TO_GO) of each loss position.
HAND = [
    (P + [21, 22] + TOOL + [23, 24], [3, 4, 8, 9], [-1.0, -2.0, -3.0, -4.0], [0, 0, 1, 1]),
    (Q0 + [51, 52, 33, 53], [7, 8, 10], [-0.5, -0.25, -0.125], [2, 2, 3]),
    (Q1 + [61, 62, 63], [2, 3, 4], [-1.5, -2.5, -3.5], [4, 4, 4]),
    (P + [21, 22] + TOOL + [26] + TOOL + [27, 28], [3, 4, 8, 12, 13], [-1.5, -2.5, -0.5, -0.25, -0.125],
     [0, 0, 1, 2, 2]),
]


def test_an_episode_with_two_segments_packs_to_three_sequences():
    seqs = build_sequences([seg_group()], AlgoConfig())
    assert len(seqs) == 4 and [s.episode for s in seqs] == [0, 0, 0, 1]
    for k, (seq, (ids, pos, behav, _)) in enumerate(zip(seqs, HAND)):
        assert seq.ids == ids, k
        assert seq.loss_mask.nonzero()[:, 0].tolist() == pos, k  # prompts and tool tokens: mask 0
        want_behav = torch.zeros(len(ids))
        want_behav[pos] = torch.tensor(behav)
        assert torch.equal(seq.behav_logprobs, want_behav), k
        # "sum": every loss token of every sequence of an episode gets the episode's advantage
        sign = 1 if seq.episode == 0 else -1
        torch.testing.assert_close(seq.advantages, torch.where(seq.loss_mask, sign * A_SUM, 0.0), rtol=0, atol=0)


def test_reward_to_go_reaches_the_turns_of_every_segment():
    seqs = build_sequences([seg_group()], AlgoConfig(turn_rewards="reward_to_go"))
    for k, (seq, (ids, pos, _, turns)) in enumerate(zip(seqs, HAND)):
        a, to_go = (A_EP, ES_TO_GO) if seq.episode == 0 else (-A_EP, EF_TO_GO)
        want = torch.zeros(len(ids))
        want[pos] = torch.stack([a + to_go[t] for t in turns])
        torch.testing.assert_close(seq.advantages, want, msg=f"sequence {k}")


def test_the_plan_keeps_an_episodes_sequences_in_its_groups_minibatch():
    # Two groups, two minibatches: group 0 is sequences 0-3 (ES's three, EF), group 1 (two samples
    # of one sequence each) 4-5. Splitting by sequence count (6 / 2 groups = 3 per group) would put
    # EF with group 1.
    trajs = [seg_group(), restarted_group()]
    lengths = [len(s.ids) for s in build_sequences(trajs, AlgoConfig())]
    loss = [4 + 3 + 3 + 5, 3 + 1]  # loss tokens per group
    for share in (False, True):
        plan = make_plan(trajs, AlgoConfig(ppo_minibatches=2), TrainerConfig(share_prefixes=share, max_tokens_per_mb=20,
                                                                              skip_zero_advantage=False), "cpu")
        got = [sorted(i for idx in mb.seq_index for i in idx) for mb in plan.minibatches]
        assert got == [[0, 1, 2, 3], [4, 5]], share
        assert [mb.loss_tokens for mb in plan.minibatches] == loss
        assert plan.tokens == sum(lengths) and plan.skipped_seqs == 0
        for mb in plan.minibatches:  # the packed loss fields hold every loss token once
            assert sum(int(batch.loss_mask.sum()) for batch in mb.micro_batches()) == mb.loss_tokens


def test_a_bad_segment_is_refused_naming_it():
    # segment 0's mask shifted by one: output token 2 (the tool token, log-prob 0) is marked sampled
    # and token 1 (log-prob −0.25, version 2) not → refused at token 1
    seg0 = es().segments[0]
    shifted = msgspec.structs.replace(seg0, loss_mask=Array.of([1, 0, 1, 1], "uint8"))
    bad = msgspec.structs.replace(es(), segments=[shifted, es().segments[1]])
    with pytest.raises(ValueError, match="group 0: sample 0: segment 0: token 1 is not sampled"):
        build_sequences([seg_group(bad)], AlgoConfig())
    short = msgspec.structs.replace(es(), segments=[es().segments[0], msgspec.structs.replace(
        es().segments[1], versions=Array.of([3, 3], "int32"))])
    with pytest.raises(ValueError, match="sample 0: segment 1: versions has shape"):
        short.check()
    # 4 turn rewards for 2 + 2 + 1 turns
    fewer = msgspec.structs.replace(es(), turn_rewards=Array.of([3.0, 1.0, 1.0, 3.0], "float32"))
    with pytest.raises(ValueError, match=r"sample 0: turn_rewards has 4 turns but .* 5 \(first 2, segments \[2, 1\]\)"):
        fewer.check()
    with pytest.raises(ValueError, match="sample 0: segment 1: turn_spans must be given"):
        es(seg1_turns=False).check()
    uncovered = msgspec.structs.replace(seg0, turn_spans=Array.of([[0, 2]], "int32"))
    with pytest.raises(ValueError, match="sample 0: segment 0: sampled token 3 lies in no turn"):
        msgspec.structs.replace(es(), turn_rewards=Array.of([3.0, 1.0, 1.0, 3.0], "float32"),
                                segments=[uncovered, es().segments[1]]).check()
    no_prompt = msgspec.structs.replace(seg0, prompt_ids=Array.of([], "int32"))
    with pytest.raises(ValueError, match="sample 0: segment 0: prompt_ids is empty"):
        msgspec.structs.replace(es(), segments=[no_prompt, es().segments[1]]).check()
    es().check()


def test_staleness_counts_from_the_oldest_sampled_token_of_a_segment():
    s = es()
    assert s.versions.numpy()[s.sampled()].min() == 3  # the first sequence alone says 3
    assert s.oldest_version() == 2  # segment 0's first turn
    assert seg_group().min_version() == 2
    assert s.sampled_versions().tolist() == [3, 3, 3, 3, 2, 2, 3, 3, 3, 3]
    # an episode whose only sampled tokens are in a segment
    late = msgspec.structs.replace(
        episode(0, [(TOOL,)], 5.0), segments=[segment(Q1, [([61], [-1.0], 1)], turns=False)])
    assert late.oldest_version() == 1
    # Through the queue: msgpack frame → in-process queue → batch → staleness at step 5: ES 5 − 2,
    # EF 5 − 3; response_len counts the sampled tokens of every sequence: (10 + 5) / 2.
    batch = through_the_queue(seg_group())
    assert batch == [seg_group()]
    m = batch_metrics(batch, step=5, step_s=1.0)
    assert m["staleness/hist"] == [3.0, 2.0]
    assert m["rollout/response_len"] == (10 + 5) / 2
    assert m["rollout/multi_version_frac"] == 0.5  # ES spans {2, 3} (across sequences)


def test_segments_round_trip_the_wire_and_are_omitted_when_empty():
    traj = seg_group()
    frame = msgspec.msgpack.encode(traj)
    back = msgspec.msgpack.decode(frame, type=Trajectory)
    assert back == traj and back.samples[0].segments[1].loss_mask is None
    assert back.samples[0].segments[0].prompt_ids.tolist() == Q0
    single = restarted_group().samples[0]
    assert b"segments" not in msgspec.msgpack.encode(single)
    assert msgspec.msgpack.encode(msgspec.structs.replace(single, segments=[])) == msgspec.msgpack.encode(single)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(single), type=Sample).segments == []


def test_the_contract_reads_and_records_every_segment():
    def batch(v):
        samples = [msgspec.structs.replace(
            episode(i, [([21], [-1.0], 0)], 0.0), seed=sample_seed(7, 0, i),
            segments=[segment(Q1, [([61], [-1.0], v), (TOOL,)], turns=False)]) for i in range(2)]
        return [Trajectory(group_id=0, prompt_ids=Array.of(P, "int32"), samples=samples, data_index=0)]

    check_batch(batch(0), step=0, batch_size=1, max_staleness=0, run_seed=7, n_samples=2)
    with pytest.raises(ContractViolation, match=r"sample \(0, 0\) has tokens of versions \[0, 1\]"):
        check_batch(batch(1), step=0, batch_size=1, max_staleness=0, run_seed=7, n_samples=2)
    dumps = []
    for v in (0, 1):
        out = io.StringIO()
        dump_batch(out, 0, batch(v))
        dumps.append(json.loads(out.getvalue()))
    assert dumps[0] != dumps[1]  # a segment's version alone changes the record
    seg = dumps[0]["groups"][0]["samples"][0]["segments"]
    assert seg == [{"prompt_ids": Q1, "output_ids": [61] + TOOL, "behav_logprobs": [-1.0, 0.0, 0.0, 0.0],
                    "versions": [0, -1, -1, -1], "loss_mask": [1, 0, 0, 0]}]
    single = io.StringIO()
    dump_batch(single, 0, [seg_group(episode(0, [([21], [-1.0], 3)], 5.0))])
    assert "segments" not in json.loads(single.getvalue())["groups"][0]["samples"][0]


def _digest(trajs, algo, trainer) -> str:
    """sha256 (first 16 hex digits) of ``build_sequences``' tensors and both ranks' plans of a
    2-rank world, with every micro-batch's packed fields."""
    h = hashlib.sha256()
    for s in build_sequences(trajs, algo):
        h.update(repr(s.ids).encode())
        for t in (s.behav_logprobs, s.loss_mask, s.advantages):
            h.update(t.numpy().tobytes())
    for rank in range(2):
        plan = make_plan(trajs, algo, trainer, "cpu", 2, rank)
        h.update(repr((plan.tokens, plan.skipped_seqs,
                       [(mb.seq_index, mb.loss_tokens, mb.run_loss_tokens) for mb in plan.minibatches])).encode())
        for mb in plan.minibatches:
            for b in mb.micro_batches():
                for name in ("input_ids", "behav_logprobs", "advantages", "loss_mask", "head_index"):
                    t = getattr(b, name, None)
                    h.update(b"none" if t is None else t.numpy().tobytes())
    return h.hexdigest()[:16]


# Digests of these batches from the code before segments existed (one sequence per sample).
BEFORE_SEGMENTS = [
    (lambda: [group0(), restarted_group()], AlgoConfig(turn_rewards="reward_to_go"),
     TrainerConfig(share_prefixes=True, skip_zero_advantage=False), "7491ef9a2baf6c3b"),
    (lambda: [group0(), restarted_group()], AlgoConfig(ppo_minibatches=2), TrainerConfig(max_tokens_per_mb=16),
     "f86acc5a69c71e01"),
    (lambda: make_trajectories(384), AlgoConfig(ppo_minibatches=2), TrainerConfig(max_tokens_per_mb=24),
     "1325df8f7272d7c5"),
    (lambda: shared_prefix_trajectories(384), AlgoConfig(ppo_minibatches=2, batch_norm=True),
     TrainerConfig(max_tokens_per_mb=30, share_prefixes=True), "d0ae2f2d9071ba5f"),
]


@pytest.mark.parametrize("case", range(len(BEFORE_SEGMENTS)))
def test_single_sequence_episodes_are_bitwise_unchanged(case):
    make, algo, trainer, want = BEFORE_SEGMENTS[case]
    trajs = make()
    assert _digest(trajs, algo, trainer) == want
    explicit = [msgspec.structs.replace(t, samples=[msgspec.structs.replace(s, segments=[]) for s in t.samples])
                for t in trajs]
    assert _digest(explicit, algo, trainer) == want
    assert all(s.episode == k for k, s in enumerate(build_sequences(trajs, algo)))
