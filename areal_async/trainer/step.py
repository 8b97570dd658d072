"""One training step of ``algo.objective``'s loss: the optimizer loop over a batch plan, on every data-parallel rank.

``trainer/plan.py`` turns the whole batch into this rank's plan; ``train_step`` runs it: per
micro-batch forward, loss, backward; per minibatch (``algo.ppo_minibatches``) one optimizer step,
skipped and counted when the gradient norm is inf or NaN. Invariants: the loss is the global token
mean over the minibatch (denominator ``Minibatch.loss_tokens``, all micro-batches of all ranks),
times the world size since FSDP2/DDP average gradients; every rank runs the same collectives
(zero-loss passes where it has fewer micro-batches). π_prox: the only forward's values, detached,
with one minibatch; a no-grad pass before the first update with several; π_behav, no pass, for
an objective that reads no π_prox (naive). ``LOGP_STAT_KEYS`` are means over the tokens run (a
minibatch with none run is left out of their average). Where the step has log-probs of the policy
it holds before the first update (π_prox, or θ of the first minibatch), they are compared with the
behaviour log-probs (``algo/mismatch.py``). Why, and skipped sequences: docs/trainer.md, "One
step" and "Exact savings".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from areal_async.algo.mismatch import MAX_KEYS, SUM_KEYS, mismatch_metrics, mismatch_sums
from areal_async.algo.objectives import OBJECTIVES
from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.trainer.packed_policy import packed_logprobs
from areal_async.trainer.plan import Minibatch, Plan, make_plan
from areal_async.types import Trajectory

STAT_KEYS = ("loss", "clip_ratio", "importance_weight", "behav_capped_ratio", "ratio", "approx_kl", "behav_kl")
# statistics that need the policy's log-probs: with sequences skipped, means over the tokens run
LOGP_STAT_KEYS = ("importance_weight", "behav_capped_ratio", "ratio", "approx_kl", "behav_kl", "entropy")


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    algo: AlgoConfig,
    trainer: TrainerConfig,
    temperature: float,
    device: torch.device,
    on_micro_batch: Callable[[int, int], None] | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """Run one step (``algo.ppo_minibatches`` optimizer updates) on this rank's share.

    Collective: every rank of the default group must call it with the same ``trajs``.
    ``on_micro_batch(done, total)``, when given, is called on the host after each micro-batch's
    backward of this rank (``total``: its micro-batches over all updates of the step; the no-grad
    proximal passes are not counted): progress only, it must not touch a device. ``version``: the
    policy version the trainer holds (steps done), for ``train/logprob_diff_*``; ``None``: no
    token is compared there.

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
        are left out when no loss token was run (every sequence skipped); so are the objective's
        own statistics (``OBJECTIVES[algo.objective].stat_keys``, e.g. icepop_masked_ratio); a
        minibatch none of whose sequences ran has none of them and is left out of their mean over
        minibatches. logprob_diff_{tokens, mean, max} and mismatch/*: behaviour vs the trainer's
        log-probs at ``version`` (``algo/mismatch.py``; compared where the step has them: the
        proximal pass, or the first minibatch's forward when it runs none), ``logprob_diff_*`` over
        the tokens sampled by ``version`` only.
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    plan = make_plan(trajs, algo, trainer, device, world, rank)
    n_mini, chunk = len(plan.minibatches), trainer.logit_chunk_tokens
    # naive PPO: π_prox = π_behav, nothing to recompute; one minibatch: π_prox = π_θ, detached
    objective = OBJECTIVES[algo.objective]
    keys = STAT_KEYS + objective.stat_keys  # the objective's own statistics: means over the tokens run
    prox = _proximal_logprobs(policy, plan, temperature, chunk, device) if n_mini > 1 and objective.needs_prox else None
    params = [p for p in policy.parameters() if p.requires_grad]
    done, skipped = 0, 0  # micro-batches run; updates skipped for a non-finite gradient norm
    # summed on the device and read once at the end: a read per micro-batch would stall the host
    # until the GPU finished it, and the next micro-batch would start with the GPU idle
    sums = torch.zeros(len(keys) + 2, dtype=torch.float64, device=device)  # + entropy, forward tokens
    n_run = sum(1 for mb in plan.minibatches if mb.run_loss_tokens)  # minibatches with log-prob statistics
    cmp_sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=device)  # behaviour vs trainer log-probs
    cmp_max = torch.full((len(MAX_KEYS),), float("-inf"), dtype=torch.float64, device=device)
    for m, minibatch in enumerate(plan.minibatches):
        scale = _stat_scale(minibatch, n_mini, n_run, device, keys)
        for j, micro_batch in enumerate(minibatch.micro_batches()):
            batch = micro_batch.to(device)
            theta, entropy = packed_logprobs(policy, batch, temperature, chunk)
            prox_logp = theta.detach() if prox is None else prox[m][j]
            loss, st = objective.loss(theta, prox_logp, batch, algo, minibatch.loss_tokens)
            (loss * world).backward()  # ranks' gradients are averaged; the loss is a global share
            ent = (entropy * batch.loss_mask).sum() / max(minibatch.loss_tokens, 1)
            sums[:-1] += torch.stack([st[k] for k in keys] + [ent.detach()]).to(torch.float64) * scale
            sums[-1] += batch.num_tokens if minibatch.seq_index[j] else 0  # a dummy pass is not counted
            if objective.needs_prox or m == 0:  # prox_logp is then the policy at `version` (naive: θ before any update)
                fresh = (batch.versions == version) if version is not None else torch.zeros_like(batch.loss_mask)
                s, mx = mismatch_sums(batch.behav_logprobs, prox_logp, batch.loss_mask, batch.cu_seqlens, fresh)
                cmp_sums += s
                torch.maximum(cmp_max, mx, out=cmp_max)
            done += 1
            if on_micro_batch is not None:
                on_micro_batch(done, plan.num_micro_batches)
        grad_norm, stepped = _clip_and_step(optimizer, params, trainer.grad_clip)
        skipped += not stepped
    if world > 1:
        dist.all_reduce(sums)
        dist.all_reduce(cmp_sums)
        dist.all_reduce(cmp_max, op=dist.ReduceOp.MAX)
    metrics = _metrics(sums.cpu().tolist(), plan, float(grad_norm), optimizer.param_groups[0]["lr"], skipped, keys)
    compared = mismatch_metrics(cmp_sums.cpu().tolist(), cmp_max.cpu().tolist())
    metrics.update({f"train/{k}": v for k, v in compared.items()})
    return metrics


def _proximal_logprobs(policy: torch.nn.Module, plan: Plan, temperature: float, chunk_tokens: int,
                       device: torch.device) -> list[list[Tensor]]:
    """log π_prox ``[T] float32`` of every micro-batch of ``plan`` (``[minibatch][micro-batch]``):
    the policy before the step's first update, in one no-grad pass."""
    with torch.no_grad():
        return [[packed_logprobs(policy, mb.to(device), temperature, chunk_tokens)[0] for mb in minibatch.micro_batches()]
                for minibatch in plan.minibatches]


def _stat_scale(minibatch: Minibatch, n_mini: int, n_run: int, device: torch.device,
                keys: tuple[str, ...]) -> Tensor:
    """``[len(keys) + 1] float64`` factor of each statistic (entropy last) of one minibatch: shares
    of its loss tokens, averaged over the ``n_mini`` minibatches; for ``LOGP_STAT_KEYS`` and the
    objective's own keys (beyond ``STAT_KEYS``) means over the tokens run, averaged over the
    ``n_run`` minibatches that ran a loss token (one whose sequences were all skipped adds 0 to
    them, and must not count in the average)."""
    run = minibatch.loss_tokens / max(minibatch.run_loss_tokens, 1)
    return torch.tensor([1.0 / n_mini if k in STAT_KEYS and k not in LOGP_STAT_KEYS else run / max(n_run, 1)
                         for k in keys + ("entropy",)], dtype=torch.float64, device=device)


def _clip_and_step(optimizer: torch.optim.Optimizer, params: list[Tensor], grad_clip: float) -> tuple[Tensor, bool]:
    """Clip the gradient norm to ``grad_clip``, step if it is finite, zero the gradients; returns
    the norm before clipping and whether the optimizer stepped.

    A non-finite gradient (one inf/NaN log-prob is enough) would make every weight NaN and reach
    the servers with the next version: the update is skipped instead. The norm is all-reduced, so
    every rank takes the same branch."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    stepped = bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def _metrics(values: list[float], plan: Plan, grad_norm: float, lr: float, skipped: int,
             keys: tuple[str, ...]) -> dict[str, float]:
    """``train/*`` metrics from the all-reduced sums ``values`` (``keys``, entropy, forward tokens)."""
    stats = dict(zip(keys + ("entropy",), values[:-1]))
    if not any(mb.run_loss_tokens for mb in plan.minibatches):
        # no loss token was run: the log-prob statistics have no tokens to average (0 would read
        # as, e.g., an entropy collapse), so they are left out of this step's metrics
        stats = {k: v for k, v in stats.items() if k in STAT_KEYS and k not in LOGP_STAT_KEYS}
    stats.update(grad_norm=grad_norm, lr=lr, tokens=float(plan.tokens), forward_tokens=values[-1],
                 skipped_seqs=float(plan.skipped_seqs), skipped_updates=float(skipped))
    return {f"train/{k}": v for k, v in stats.items()}
