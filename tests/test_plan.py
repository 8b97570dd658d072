"""The batch plan (``trainer/plan.py``), on the host: no model, no forward.

Batches are those of ``tests/support/batches.py``. ``make_trajectories``: 4 groups × 2 samples,
sample (g, i) is sequence ``2g + i``; rewards ±5 in groups 0–2 (advantages ±5 / (5 + 1e-6), the
population std of {5, −5} being 5), all +5 in group 3 (advantage 0); sample (1, 0) has an empty
response. ``shared_prefix_trajectories``: 5 groups × 4, sequence ``4g + i``; groups 1 and 3
all-equal (advantage 0), sample (2, 0) an empty response: 9 sequences skipped.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.packing import PackedBatch
from areal_async.trainer.plan import make_plan
from areal_async.trainer.tree import TreeBatch
from tests.support.batches import make_trajectories, shared_prefix_trajectories


def _plans(trajs, world: int = 1, n_mini: int = 1, **trainer_kwargs):
    cfg = TrainerConfig(**trainer_kwargs)
    return [make_plan(trajs, AlgoConfig(ppo_minibatches=n_mini), cfg, "cpu", world, rank) for rank in range(world)]


def _lengths(trajs):
    """(prompt length, response length) of every sequence, in plan order."""
    return [(len(t.prompt_ids.tolist()), len(s.output_ids.tolist())) for t in trajs for s in t.samples]


@pytest.mark.parametrize("n_mini", [1, 2])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_each_sequence_runs_once_on_one_rank(skip, share, n_mini):
    # 2 ranks, a budget of 30 tokens (trees cut). Minibatch bounds round(m · 5 / n) · 4: with two
    # minibatches round(2.5) = 2 groups, then 3: sequences [0, 8) and [8, 20).
    trajs = shared_prefix_trajectories(384)
    plans = _plans(trajs, 2, n_mini, max_tokens_per_mb=30, share_prefixes=share, skip_zero_advantage=skip)
    skipped = {4, 5, 6, 7, 8, 12, 13, 14, 15} if skip else set()
    bounds = [0, 20] if n_mini == 1 else [0, 8, 20]
    lengths = _lengths(trajs)
    for plan in plans:
        assert len(plan.minibatches) == n_mini
        assert plan.skipped_seqs == len(skipped)
        assert plan.tokens == sum(p + r for p, r in lengths)
    for m in range(n_mini):
        every = range(bounds[m], bounds[m + 1])
        run = sorted(set(every) - skipped)
        shares = [plan.minibatches[m] for plan in plans]
        assert sorted(i for mb in shares for idx in mb.seq_index for i in idx) == run
        assert len(shares[0].seq_index) == len(shares[1].seq_index)  # the same collectives
        for mb in shares:
            assert mb.loss_tokens == sum(lengths[i][1] for i in every)  # skipped sequences counted
            assert mb.run_loss_tokens == sum(lengths[i][1] for i in run)
            for batch, idx in zip(mb.micro_batches(), mb.seq_index, strict=True):
                assert isinstance(batch, TreeBatch if share and idx else PackedBatch)
                if idx:  # the loss fields span the unshared layout of its sequences
                    assert batch.loss_mask.numel() == sum(sum(lengths[i]) for i in idx)


@pytest.mark.parametrize("share", [False, True])
def test_loss_fields_mark_exactly_the_response_tokens(share):
    # Per micro-batch, in the unshared layout (its sequences back to back): the loss mask is true at
    # positions P-1 … P+R-2 of each sequence, the behaviour log-probs there are the sample's, the
    # advantages its group advantage (0 elsewhere), and the LM head reads exactly those rows with
    # the response tokens as labels. Nothing skipped, so group 3 (advantage 0) is in the plan too.
    trajs = make_trajectories(384)
    (plan,) = _plans(trajs, max_tokens_per_mb=24, share_prefixes=share, skip_zero_advantage=False)
    samples = [(t, s) for t in trajs for s in t.samples]
    adv = 5.0 / (5.0 + 1e-6)
    covered = []
    for mb in plan.minibatches:
        for batch, idx in zip(mb.micro_batches(), mb.seq_index, strict=True):
            covered += idx
            assert batch.loss_mask.dtype == torch.bool
            offset, labels = 0, []
            for k in idx:
                traj, s = samples[k]
                p, r = len(traj.prompt_ids.tolist()), len(s.output_ids.tolist())
                seg = slice(offset, offset + p + r)
                mask, behav, a = batch.loss_mask[seg], batch.behav_logprobs[seg], batch.advantages[seg]
                assert mask.nonzero()[:, 0].tolist() == list(range(p - 1, p - 1 + r)), k
                assert torch.equal(behav[mask], torch.tensor(s.behav_logprobs.numpy())), k
                assert not behav[~mask].any() and not a[~mask].any(), k
                g, i = divmod(k, 2)
                want = 0.0 if g == 3 else (adv if i == g % 2 else -adv)
                torch.testing.assert_close(a[mask], torch.full((r,), want), msg=str(k))
                labels += s.output_ids.tolist()
                offset += p + r
            assert batch.loss_mask.numel() == batch.advantages.numel() == batch.behav_logprobs.numel() == offset
            _, head_labels, out_index, _ = batch.head_rows()
            assert out_index.tolist() == batch.loss_mask.nonzero()[:, 0].tolist()
            assert head_labels.tolist() == labels
    assert sorted(covered) == list(range(8))


def test_a_rank_without_sequences_runs_one_dummy_pass():
    # every group all-equal: nothing runs; each of 2 ranks gets one dummy micro-batch (1 token, no
    # loss token) while the denominator still counts every loss token
    trajs = [msgspec.structs.replace(t, samples=[msgspec.structs.replace(s, reward=5.0) for s in t.samples])
             for t in make_trajectories(384)]
    for plan in _plans(trajs, 2):
        (mb,) = plan.minibatches
        assert mb.seq_index == [()] and plan.skipped_seqs == 8 and plan.num_micro_batches == 1
        (batch,) = mb.micro_batches()
        assert batch.num_tokens == 1 and not batch.loss_mask.any() and not batch.advantages.any()
        assert mb.run_loss_tokens == 0
        assert mb.loss_tokens == sum(r for _, r in _lengths(trajs)) > 0


@pytest.mark.parametrize("share", [False, True])
def test_a_micro_batch_moves_with_its_loss_fields(share):
    (plan,) = _plans(make_trajectories(384), max_tokens_per_mb=4096, share_prefixes=share)
    batch = next(plan.minibatches[0].micro_batches())
    moved = batch.to("meta")
    for name in ("input_ids", "head_index", "behav_logprobs", "advantages", "loss_mask"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(batch, name).shape, name
