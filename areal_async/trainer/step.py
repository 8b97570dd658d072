"""One decoupled-PPO training step over a batch of trajectories, on every data-parallel rank.

Every rank receives the whole batch (the same list of ``Trajectory``s) and builds the same
token tensors; the sequences are then split into balanced micro-batches under
``trainer.max_tokens_per_mb`` (``packing.allocate_micro_batches``) and dealt round-robin to ranks
(``packing.assign_to_ranks``), so the allocation is a function of the batch only.

Two exact savings (``trainer.skip_zero_advantage``, ``trainer.share_prefixes``, both on by
default):

- **Zero-advantage skip.** A sequence whose every loss token has advantage exactly 0 (a group
  with all-equal rewards; an empty response) is not run. Its per-token loss is
  ``-w·max(-0·r, -0·clip(r)) = 0`` with gradient 0 for any log-probs, so the loss, its gradient
  and the clip fraction are unchanged, and the denominator still counts its loss tokens. Only
  while no term is non-zero at A = 0 (``algo.kl_coef = 0``; there is no entropy bonus). The
  statistics that need its log-probs (``LOGP_STAT_KEYS``) cannot be had without its forward:
  they are means over the loss tokens that were run. One difference: a non-finite behaviour
  log-prob in a skipped sequence no longer makes the update's gradient NaN (nothing reads it).
- **Shared-prefix packing** (``trainer/tree.py``): each micro-batch's sequences are forwarded as
  a forest of token tries, shared prefixes once; the allocation units are the trees (cut where
  over the budget) costing their unique tokens. The LM head runs only at loss positions (also
  without sharing).

Per token, position ``t`` of a sequence ``prompt + response`` predicts token ``t+1``; the loss
mask is true on the positions that predict response tokens, and the behaviour log-prob and the
advantage of response token ``j`` sit at position ``P-1+j``.

Aggregation is the global token mean over the whole (mini)batch: the denominator is the number
of loss tokens over all micro-batches of all ranks (known on every rank, since every rank holds
the whole batch), and the loss is multiplied by the world size because FSDP2/DDP average
gradients over ranks. A rank with fewer micro-batches runs zero-loss passes so that every rank
runs the same collectives.

``algo.ppo_minibatches`` = n splits the batch into n consecutive slices of groups with one
optimizer step each. With n = 1, π_prox (the policy before the update) equals π_θ during the only
forward, so the proximal log-probs are that forward's values, detached; with n > 1 they are
recomputed in a no-grad pass over the whole batch before the first update. ``algo.decoupled``
false (the naive-PPO control) takes π_prox = π_behav instead and runs no proximal pass at any n
(``algo.loss.naive_ppo_loss``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from areal_async.algo.advantages import batch_normalize, group_advantages
from areal_async.algo.loss import decoupled_ppo_loss, naive_ppo_loss
from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.packed_policy import packed_logprobs
from areal_async.trainer.packing import PackedBatch, allocate_micro_batches, assign_to_ranks, pack_sequences, to_device
from areal_async.trainer.tree import TreeBatch, cut_units, pack_tree
from areal_async.trainer.tree_paths import tree_attention_choice
from areal_async.types import Trajectory

STAT_KEYS = ("loss", "clip_ratio", "importance_weight", "behav_capped_ratio", "ratio", "approx_kl", "behav_kl")
# statistics that need the policy's log-probs: with sequences skipped, means over the tokens run
LOGP_STAT_KEYS = ("importance_weight", "behav_capped_ratio", "ratio", "approx_kl", "behav_kl", "entropy")


@dataclasses.dataclass
class SeqTensors:
    """One sequence ``prompt + response`` aligned to next-token positions (all ``[L]``)."""

    ids: list[int]
    behav_logp: Tensor  # float32, log π_behav of token t+1 at position t (0 off the mask)
    loss_mask: Tensor  # bool
    advantages: Tensor  # float32


def build_sequences(trajs: list[Trajectory], algo: AlgoConfig) -> list[SeqTensors]:
    """Token tensors of every sample of every group, groups in id order, samples in index order.

    Raises:
        ValueError: groups of different sizes (advantages are normalised per group).
    """
    trajs = sorted(trajs, key=lambda t: t.group_id)
    sizes = {len(t.samples) for t in trajs}
    if len(sizes) != 1:
        raise ValueError(f"all groups of a batch must have the same number of samples, got sizes {sorted(sizes)}")
    samples = [(t, s) for t in trajs for s in sorted(t.samples, key=lambda s: s.index)]
    rewards = torch.tensor([s.reward for _, s in samples], dtype=torch.float32)
    adv = group_advantages(rewards, sizes.pop(), std_norm=algo.std_norm)
    if algo.batch_norm:
        adv = batch_normalize(adv)
    out = []
    for (traj, s), a in zip(samples, adv.tolist()):
        prompt, resp = traj.prompt_ids.tolist(), s.output_ids.tolist()
        n_p, n_r = len(prompt), len(resp)
        assert n_p >= 1, f"group {traj.group_id} has an empty prompt"
        length = n_p + n_r
        mask = torch.zeros(length, dtype=torch.bool)
        mask[n_p - 1 : length - 1] = True
        behav = torch.zeros(length, dtype=torch.float32)
        behav[n_p - 1 : length - 1] = torch.from_numpy(s.behav_logprobs.numpy().astype("float32"))
        out.append(SeqTensors(prompt + resp, behav, mask, torch.where(mask, a, 0.0)))
    return out


def _pack(seqs: list[SeqTensors], idx: list[int], device: torch.device, share_prefixes: bool,
          tree_attention: str = "sdpa") -> tuple[PackedBatch | TreeBatch, dict[str, Tensor]]:
    """Pack sequences ``idx`` as a prefix forest (``share_prefixes``, attention path
    ``tree_attention``) or back to back, with the LM head at their loss positions only (a dummy
    1-token, all-masked row when ``idx`` is empty)."""
    if not idx:
        one = torch.zeros(1, device=device)
        return pack_sequences([[0]]).to(device), {"behav_logp": one, "loss_mask": one.bool(), "advantages": one}
    keys = ("behav_logp", "loss_mask", "advantages")
    fields = {k: torch.cat([getattr(seqs[i], k) for i in idx]) for k in keys}
    head_index = fields["loss_mask"].nonzero()[:, 0]
    ids = [seqs[i].ids for i in idx]
    batch = pack_tree(ids, head_index, tree_attention) if share_prefixes else pack_sequences(ids, head_index)
    return batch.to(device), {k: to_device(v, device) for k, v in fields.items()}


def runs_forward(seq: SeqTensors) -> bool:
    """Whether a sequence must be forwarded: some loss token has a non-zero advantage (NaN counts
    as non-zero). One with none adds exactly 0 to the loss and the gradient (see the module
    docstring) and is skipped when ``trainer.skip_zero_advantage`` is on."""
    return bool((seq.advantages[seq.loss_mask] != 0).any())


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    algo: AlgoConfig,
    trainer: TrainerConfig,
    temperature: float,
    device: torch.device,
    on_micro_batch: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Run one step (``algo.ppo_minibatches`` optimizer updates) on this rank's share.

    Collective: every rank of the default group must call it with the same ``trajs``.
    ``on_micro_batch(done, total)``, when given, is called on the host after each micro-batch's
    backward of this rank (``total``: its micro-batches over all updates of the step; the no-grad
    proximal passes are not counted): progress only, it must not touch a device.

    Returns:
        ``train/*`` metrics (global token means over all ranks), identical on every rank:
        loss, clip_ratio, importance_weight, behav_capped_ratio, ratio, approx_kl, behav_kl,
        entropy, grad_norm (before clipping, last update), lr, tokens (sequence tokens of the
        batch, Σ prompt + response, as if every sequence ran unshared), forward_tokens (tokens
        actually put through the model, dummy passes excluded), skipped_seqs (sequences not
        run for all-zero advantages), skipped_updates (optimizer updates of this step skipped
        because the gradient norm was inf or NaN; the weights then stay as they were).
        loss and clip_ratio are over every loss token of the batch; the statistics that need
        log-probs (``LOGP_STAT_KEYS``: importance_weight, behav_capped_ratio, ratio, approx_kl,
        behav_kl, entropy) are means over the loss tokens of the sequences that were run, and
        are left out when no loss token was run (every sequence skipped).
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    seqs = build_sequences(trajs, algo)
    n_groups, n_mini = len(trajs), algo.ppo_minibatches
    if not 1 <= n_mini <= n_groups:
        raise ValueError(f"algo.ppo_minibatches={n_mini} must be in [1, groups per batch = {n_groups}]")
    per_group = len(seqs) // n_groups
    bounds = [round(i * n_groups / n_mini) * per_group for i in range(n_mini + 1)]
    minibatches = [list(range(bounds[i], bounds[i + 1])) for i in range(n_mini)]
    # skipping is exact only while nothing in the loss is non-zero at A = 0 (config rejects kl_coef ≠ 0)
    skip = trainer.skip_zero_advantage and algo.kl_coef == 0.0
    runs = [[i for i in mb if not skip or runs_forward(seqs[i])] for mb in minibatches]
    share = trainer.share_prefixes
    tree_path = tree_attention_choice(trainer.tree_attention, torch.device(device).type == "cuda", trainer.dtype,
                                      torch.are_deterministic_algorithms_enabled())
    plans = [_plan(seqs, run, trainer.max_tokens_per_mb, world, share)[rank] for run in runs]

    total_mbs, done_mbs = sum(len(plan) for plan in plans), 0
    prox: dict[int, Tensor] = {}  # micro-batch key → π_prox log-probs, when recomputed
    if n_mini > 1 and algo.decoupled:  # naive PPO: π_prox = π_behav, nothing to recompute
        with torch.no_grad():
            for m, plan in enumerate(plans):
                for j, idx in enumerate(plan):
                    batch, _ = _pack(seqs, idx, device, share, tree_path)
                    prox[(m, j)] = packed_logprobs(policy, batch, temperature, trainer.logit_chunk_tokens)[0]

    params = [p for p in policy.parameters() if p.requires_grad]
    skipped = 0  # optimizer updates skipped for a non-finite gradient norm
    # summed on the device and read once at the end: a read per micro-batch would stall the host
    # until the GPU finished it, and the next micro-batch would start with the GPU idle
    sums = torch.zeros(len(STAT_KEYS) + 2, dtype=torch.float64, device=device)  # + entropy, forward tokens
    for m, plan in enumerate(plans):
        num_tokens = sum(int(seqs[i].loss_mask.sum()) for i in minibatches[m])
        run_tokens = sum(int(seqs[i].loss_mask.sum()) for i in runs[m])
        # shares of num_tokens → means over the tokens run, for the statistics that need log-probs
        scale = torch.tensor([1.0 if k not in LOGP_STAT_KEYS else num_tokens / max(run_tokens, 1)
                              for k in STAT_KEYS + ("entropy",)], dtype=torch.float64, device=device) / n_mini
        for j, idx in enumerate(plan):
            batch, f = _pack(seqs, idx, device, share, tree_path)
            theta, entropy = packed_logprobs(policy, batch, temperature, trainer.logit_chunk_tokens)
            if algo.decoupled:
                prox_logp = prox[(m, j)] if n_mini > 1 else theta.detach()
                loss, st = decoupled_ppo_loss(
                    theta, prox_logp, f["behav_logp"], f["advantages"], f["loss_mask"],
                    algo.eps_clip, algo.eps_clip_high, algo.behav_imp_weight_cap, num_tokens=num_tokens,
                )
            else:
                loss, st = naive_ppo_loss(theta, f["behav_logp"], f["advantages"], f["loss_mask"],
                                          algo.eps_clip, algo.eps_clip_high, num_tokens=num_tokens)
            (loss * world).backward()  # ranks' gradients are averaged; the loss is a global share
            ent = (entropy * f["loss_mask"]).sum() / max(num_tokens, 1)
            sums[:-1] += torch.stack([st[k] for k in STAT_KEYS] + [ent.detach()]).to(torch.float64) * scale
            sums[-1] += batch.num_tokens if idx else 0
            done_mbs += 1
            if on_micro_batch is not None:
                on_micro_batch(done_mbs, total_mbs)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # A non-finite gradient (one inf/NaN log-prob is enough) would make every weight NaN and
        # reach the servers with the next version: the update is skipped and counted instead. The
        # norm is all-reduced, so every rank takes the same branch.
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    if world > 1:
        dist.all_reduce(sums)
    values = sums.cpu().tolist()
    stats = dict(zip(STAT_KEYS + ("entropy",), values[:-1]))
    if not any(seqs[i].loss_mask.any() for run in runs for i in run):
        # no loss token was run: the log-prob statistics have no tokens to average (0 would read
        # as, e.g., an entropy collapse), so they are left out of this step's metrics
        stats = {k: v for k, v in stats.items() if k not in LOGP_STAT_KEYS}
    tokens = float(sum(len(s.ids) for s in seqs))
    stats.update(grad_norm=float(grad_norm), lr=optimizer.param_groups[0]["lr"], tokens=tokens,
                 forward_tokens=values[-1], skipped_seqs=float(len(seqs) - sum(len(r) for r in runs)),
                 skipped_updates=float(skipped))
    return {f"train/{k}": v for k, v in stats.items()}


def _plan(seqs: list[SeqTensors], idx: list[int], max_tokens_per_mb: int, world: int,
          share_prefixes: bool) -> list[list[list[int]]]:
    """Micro-batches of the sequences ``idx`` (global indices, ascending in each), dealt to
    ``world`` ranks. The allocation units are the sequences (cost: length) or, with
    ``share_prefixes``, their prefix trees, cut where over the budget (cost: unique tokens)."""
    if share_prefixes:
        units = [([idx[k] for k in members], cost)
                 for members, cost in cut_units([seqs[i].ids for i in idx], max_tokens_per_mb)]
    else:
        units = [([i], len(seqs[i].ids)) for i in idx]
    mbs = allocate_micro_batches([cost for _, cost in units], max_tokens_per_mb)
    return assign_to_ranks([sorted(i for u in mb for i in units[u][0]) for mb in mbs], world)
