"""The batch plan: how a consumed batch becomes each rank's packed micro-batches.

``make_plan`` runs on every rank over the whole batch: ``build_sequences`` (ids, behaviour
log-probs, GRPO advantages, loss mask: true only on sampled tokens; versions), the zero-advantage
skip (``runs_forward``), the ``algo.ppo_minibatches`` split, balanced micro-batches under
``trainer.max_tokens_per_mb`` dealt round-robin to ranks (``assign_micro_batches``). The plan holds
index lists; ``pack_micro_batch`` makes a ``PackedBatch`` or ``TreeBatch`` with its own ``[T]`` loss
fields when the step reaches it. Invariants: the plan is a function of the batch (token ids,
rewards, config, world size), never of timing or arrival order; each sequence is in one minibatch
and, unless skipped, one micro-batch of one rank; every rank has as many micro-batches per minibatch
(at least one), so all run the same collectives. Position ``t`` predicts token ``t+1``; output token
``j``'s loss fields sit at ``P-1+j``. Why: docs/trainer.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from areal_async.algo.advantages import batch_normalize, group_advantages, turn_advantages
from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.tree_paths import tree_attention_choice
from areal_async.trainer.packing import PackedBatch, allocate_micro_batches, assign_to_ranks, pack_sequences
from areal_async.trainer.tree import TreeBatch, cut_units, pack_tree
from areal_async.types import Sample, Segment, Trajectory

LOSS_FIELDS = ("behav_logprobs", "advantages", "loss_mask", "versions")


@dataclasses.dataclass
class SeqTensors:
    """One sequence ``prompt + output_ids`` aligned to next-token positions (all ``[L]``);
    ``episode``: its sample's index in the batch order (groups by id, samples by index), shared by
    the episode's sequences; ``versions``: ``None`` stands for -1 everywhere."""

    ids: list[int]
    behav_logprobs: Tensor  # float32, log π_behav of token t+1 at position t (0 off the mask)
    loss_mask: Tensor  # bool
    advantages: Tensor  # float32
    episode: int = 0
    versions: Tensor | None = None  # int32, the policy version that sampled token t+1 (-1 off the mask)

    def __post_init__(self) -> None:
        if self.versions is None:
            self.versions = torch.full((len(self.ids),), -1, dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class Minibatch:
    """This rank's share of one optimizer update.

    Fields:
        seq_index: this rank's micro-batches, each as its sequences' indices into
            ``build_sequences``' order; at least one: a rank with none gets the dummy ``()`` (1
            token, no loss token), at most one dummy, last.
        loss_tokens: loss tokens of every sequence of the update, all ranks, skipped ones
            included: the loss's denominator (the global token mean).
        run_loss_tokens: loss tokens of the sequences run, all ranks.
        pack: ``seq_index[j]`` → that micro-batch (``pack_micro_batch`` bound to the batch's
            sequences and the packing choice).
    """

    seq_index: list[tuple[int, ...]]
    loss_tokens: int
    run_loss_tokens: int
    pack: Callable[[tuple[int, ...]], PackedBatch | TreeBatch]

    def micro_batches(self) -> Iterator[PackedBatch | TreeBatch]:
        """This rank's micro-batches in order, each packed on the host with its loss fields when
        the iteration reaches it: the host packs the next one while the device still runs the one
        before (packed all up front, the device would wait for every one of them)."""
        return (self.pack(idx) for idx in self.seq_index)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One training step of this rank: ``minibatches`` in update order; ``tokens`` the batch's
    Σ prompt + response (as if every sequence ran unshared); ``skipped_seqs`` the sequences not
    run for all-zero advantages (all ranks)."""

    minibatches: list[Minibatch]
    tokens: int
    skipped_seqs: int

    @property
    def num_micro_batches(self) -> int:
        return sum(len(mb.seq_index) for mb in self.minibatches)


def make_plan(trajs: list[Trajectory], algo: AlgoConfig, trainer: TrainerConfig, device: torch.device | str,
              world: int = 1, rank: int = 0) -> Plan:
    """Rank ``rank``'s plan of the batch ``trajs`` (see the module docstring).

    ``algo.ppo_minibatches`` = n splits the batch into n consecutive slices of groups. The
    zero-advantage skip applies with ``trainer.skip_zero_advantage`` and ``algo.kl_coef`` = 0.
    ``device`` (where the micro-batches will run) picks the tree attention path.

    Raises:
        ValueError: groups of different sizes, ``algo.ppo_minibatches`` outside [1, groups], or a
            tree attention path the device cannot run (``tree_paths.tree_attention_choice``).
    """
    seqs = build_sequences(trajs, algo)
    n_groups, n_mini = len(trajs), algo.ppo_minibatches
    if not 1 <= n_mini <= n_groups:
        raise ValueError(f"algo.ppo_minibatches={n_mini} must be in [1, groups per batch = {n_groups}]")
    # minibatch m: groups [round(m·G/n), round((m+1)·G/n)), i.e. their episodes' sequences
    per_group, episodes = len(trajs[0].samples), [s.episode for s in seqs]
    bounds = [bisect.bisect_left(episodes, round(i * n_groups / n_mini) * per_group) for i in range(n_mini + 1)]
    # skipping is exact only while nothing in the loss is non-zero at A = 0 (config rejects kl_coef ≠ 0)
    skip = trainer.skip_zero_advantage and algo.kl_coef == 0.0
    share = trainer.share_prefixes
    tree_path = tree_attention_choice(trainer.tree_attention, torch.device(device).type == "cuda", trainer.dtype,
                                      torch.are_deterministic_algorithms_enabled())
    pack = functools.partial(pack_micro_batch, seqs, share_prefixes=share, tree_attention=tree_path)
    minibatches, skipped = [], 0
    for m in range(n_mini):
        every = range(bounds[m], bounds[m + 1])
        run = [i for i in every if not skip or runs_forward(seqs[i])]
        mine = assign_micro_batches(seqs, run, trainer.max_tokens_per_mb, world, share)[rank]
        minibatches.append(Minibatch(seq_index=[tuple(idx) for idx in mine],
                                     loss_tokens=sum(int(seqs[i].loss_mask.sum()) for i in every),
                                     run_loss_tokens=sum(int(seqs[i].loss_mask.sum()) for i in run), pack=pack))
        skipped += len(every) - len(run)
    return Plan(minibatches, tokens=sum(len(s.ids) for s in seqs), skipped_seqs=skipped)


def build_sequences(trajs: list[Trajectory], algo: AlgoConfig) -> list[SeqTensors]:
    """Token tensors of every sequence of every sample of every group: groups in id order, samples
    in index order, a sample's first sequence then its segments in order (``SeqTensors.episode``
    names the sample).

    A sample's first sequence is ``prompt + output_ids``, a segment's ``segment.prompt_ids +
    segment.output_ids``; its sampled tokens (``Sample.sampled()`` / ``Segment.sampled()``: a
    response's every token, an episode's model turns) are its loss tokens, the others (prompts,
    tool results, environment and template tokens) get loss mask 0, behaviour log-prob 0, version
    -1 and advantage 0, however many of them sit between the turns. A loss token of any sequence of
    an episode gets the episode's group advantage (``algo.std_norm``, ``algo.batch_norm``) over the
    group's episode returns: with per-turn rewards and ``algo.turn_rewards = "sum"`` (the
    default) the return is the episode reward plus their sum; with ``"reward_to_go"`` the return is
    the episode reward and a loss token also gets its turn's ``turn_advantages`` (not
    batch-normalised; the episode's turns in order: the first sequence's, then each segment's).
    Without per-turn rewards the advantages are exactly the single-response ones. An episode the
    environment ended (``EpisodeStats.env_error``) has advantage 0 and no loss token (nothing of
    it is trained, nor counted in the loss's denominator), and its return enters no statistics: its
    group's other samples are normalised as a group of their own, and ``batch_norm`` leaves it out.
    So does an empty episode (no model turn, ``Sample.empty``), which has no token to train.

    Raises:
        ValueError: groups of different sizes (advantages are normalised per group), or a sample
            whose fields disagree (``Sample.check``).
    """
    trajs = sorted(trajs, key=lambda t: t.group_id)
    sizes = {len(t.samples) for t in trajs}
    if len(sizes) != 1:
        raise ValueError(f"all groups of a batch must have the same number of samples, got sizes {sorted(sizes)}")
    group_size = sizes.pop()
    samples = [(t, s) for t in trajs for s in sorted(t.samples, key=lambda s: s.index)]
    for traj, s in samples:
        try:
            s.check()
        except ValueError as e:
            raise ValueError(f"group {traj.group_id}: {e}") from None
    summed = algo.turn_rewards == "sum"
    rewards = torch.tensor([s.episode_return() if summed else s.reward for _, s in samples], dtype=torch.float32)
    left_out = {j for j, (_, s) in enumerate(samples) if not s.scored()}  # env-ended or empty episodes
    adv = group_advantages(rewards, group_size, std_norm=algo.std_norm)
    for g in sorted({j // group_size for j in left_out}):  # the group's other samples, as a group of their own
        kept = [j for j in range(g * group_size, (g + 1) * group_size) if j not in left_out]
        adv[g * group_size : (g + 1) * group_size] = 0.0
        if kept:
            adv[kept] = group_advantages(rewards[kept], len(kept), std_norm=algo.std_norm)
    if algo.batch_norm:
        adv = batch_normalize(adv, torch.tensor([j not in left_out for j in range(len(samples))])) if left_out \
            else batch_normalize(adv)
    to_go = {} if summed else _turn_advantages(samples, group_size, left_out)
    out = []
    for j, ((traj, s), a) in enumerate(zip(samples, adv.tolist())):
        turns = iter(to_go.get(j, ()))
        for prompt_ids, seq in [(traj.prompt_ids, s)] + [(seg.prompt_ids, seg) for seg in s.segments]:
            out.append(_sequence(traj.group_id, prompt_ids.tolist(), seq, a, turns if j in to_go else None, j,
                                 trained=j not in left_out))
    return out


def _sequence(group_id: int, prompt: list[int], seq: Sample | Segment, a: float, turns: Iterator[float] | None,
              episode: int, trained: bool = True) -> SeqTensors:
    """One sequence ``prompt + seq.output_ids``: advantage ``a`` on its sampled tokens, plus, with
    ``turns`` (the episode's remaining per-turn advantages), the next one per span of
    ``seq.turn_spans``; not ``trained``: no loss token."""
    resp = seq.output_ids.tolist()
    n_p, n_r = len(prompt), len(resp)
    assert n_p >= 1, f"group {group_id} has an empty prompt"
    length = n_p + n_r
    mask = torch.zeros(length, dtype=torch.bool)
    if trained:
        mask[n_p - 1 : length - 1] = torch.from_numpy(seq.sampled())  # position t predicts token t+1
    behav = torch.zeros(length, dtype=torch.float32)
    behav[n_p - 1 : length - 1] = torch.from_numpy(seq.behav_logprobs.numpy().astype("float32"))
    versions = torch.full((length,), -1, dtype=torch.int32)
    versions[n_p - 1 : length - 1] = torch.from_numpy(seq.versions.numpy().astype("int32"))
    advantages = torch.where(mask, a, 0.0)
    if turns is not None:
        for (start, end), turn_adv in zip(seq.turn_spans.numpy().tolist(), turns):
            advantages[n_p - 1 + start : n_p - 1 + end] += turn_adv
    return SeqTensors(prompt + resp, behav, mask, torch.where(mask, advantages, 0.0), episode,
                      torch.where(mask, versions, -1))


def _turn_advantages(samples: list[tuple[Trajectory, Sample]], group_size: int,
                     left_out: set[int] = frozenset()) -> dict[int, list[float]]:
    """``turn_advantages`` of the samples with per-turn rewards, but those ``left_out``: sample
    index → one per turn."""
    with_turns = [j for j, (_, s) in enumerate(samples) if s.turn_rewards is not None and j not in left_out]
    if not with_turns:
        return {}
    rewards = [torch.from_numpy(samples[j][1].turn_rewards.numpy().astype("float32")) for j in with_turns]
    owner = torch.cat([torch.full((len(r),), j, dtype=torch.int64) for j, r in zip(with_turns, rewards)])
    values = turn_advantages(torch.cat(rewards), owner, group_size).tolist()
    out, k = {}, 0
    for j, r in zip(with_turns, rewards):
        out[j], k = values[k : k + len(r)], k + len(r)
    return out


def runs_forward(seq: SeqTensors) -> bool:
    """Whether a sequence must be forwarded: some loss token has a non-zero advantage (NaN counts
    as non-zero).

    One with none is skipped when ``trainer.skip_zero_advantage`` is on (a group with all-equal
    rewards; an empty response). Its per-token loss is ``-w·max(-0·r, -0·clip(r)) = 0`` with
    gradient 0 for any log-probs, so the loss, its gradient and the clip fraction are unchanged,
    and the denominator (``Minibatch.loss_tokens``) still counts its loss tokens; only while no
    term is non-zero at A = 0 (``algo.kl_coef = 0``; there is no entropy bonus). A non-finite
    behaviour log-prob in a skipped sequence no longer makes the update's gradient NaN.
    """
    return bool((seq.advantages[seq.loss_mask] != 0).any())


def assign_micro_batches(seqs: list[SeqTensors], idx: list[int], max_tokens_per_mb: int, world: int,
                         share_prefixes: bool) -> list[list[list[int]]]:
    """Micro-batches of the sequences ``idx`` (global indices, ascending in each), ``[world][M]``,
    dealt round-robin to ranks (``packing.assign_to_ranks``, ``[]`` where a rank runs out). The
    allocation units are the sequences (cost: length) or, with ``share_prefixes``, their prefix
    trees, cut where over the budget (cost: unique tokens; ``tree.cut_units``)."""
    if share_prefixes:
        units = [([idx[k] for k in members], cost)
                 for members, cost in cut_units([seqs[i].ids for i in idx], max_tokens_per_mb)]
    else:
        units = [([i], len(seqs[i].ids)) for i in idx]
    mbs = allocate_micro_batches([cost for _, cost in units], max_tokens_per_mb)
    return assign_to_ranks([sorted(i for u in mb for i in units[u][0]) for mb in mbs], world)


def pack_micro_batch(seqs: list[SeqTensors], idx: Sequence[int], share_prefixes: bool,
                     tree_attention: str = "sdpa") -> PackedBatch | TreeBatch:
    """Sequences ``idx`` as a prefix forest (``share_prefixes``, attention path ``tree_attention``)
    or back to back, on the host, with their loss fields (``[T]``, ``T`` = Σ their lengths) and
    the LM head at their loss positions only. For ``idx`` empty, the dummy: one token ``[0]``,
    all-masked loss fields, the head at that position."""
    if not idx:
        zero = torch.zeros(1)
        return dataclasses.replace(pack_sequences([[0]]), behav_logprobs=zero, advantages=zero, loss_mask=zero.bool(),
                                   versions=torch.full((1,), -1, dtype=torch.int32))
    fields = {k: torch.cat([getattr(seqs[i], k) for i in idx]) for k in LOSS_FIELDS}
    head_index = fields["loss_mask"].nonzero()[:, 0]
    ids = [seqs[i].ids for i in idx]
    batch = pack_tree(ids, head_index, tree_attention) if share_prefixes else pack_sequences(ids, head_index)
    return dataclasses.replace(batch, **fields)
