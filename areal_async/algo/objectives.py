"""The policy losses ``algo.objective`` chooses from: a registry, name → ``Objective``.

Every entry calls one pure loss of ``algo/loss.py`` or ``algo/corrections.py`` with its
hyperparameters from ``AlgoConfig``. ``needs_prox``: whether the loss reads π_prox (naive PPO takes
π_prox = π_behav, so the trainer runs no proximal forward for it); ``stat_keys``: the statistics
the loss returns beyond ``trainer/step.py``'s common ones, logged as ``train/<key>``
(docs/metrics.md). What each objective is and its knobs: docs/objectives.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from torch import Tensor

from areal_async.algo.corrections import gspo_loss, icepop_loss, m2po_loss, mis_loss, tis_loss
from areal_async.algo.loss import decoupled_ppo_loss, naive_ppo_loss
from areal_async.config import AlgoConfig


class LossBatch(Protocol):
    """The per-token loss fields of a micro-batch (``PackedBatch`` or ``TreeBatch``), ``[T]`` each,
    and ``cu_seqlens [B+1] int32``, the sequences of those ``T`` positions."""

    behav_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor


# (theta [T] with grad, prox [T], batch, algo, num_tokens of the step's minibatch) → (loss, stats)
LossFn = Callable[[Tensor, Tensor, LossBatch, AlgoConfig, int], tuple[Tensor, dict[str, Tensor]]]


class Objective(NamedTuple):
    loss: LossFn
    needs_prox: bool
    stat_keys: tuple[str, ...] = ()


def _decoupled(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return decoupled_ppo_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, a.eps_clip,
                              a.eps_clip_high, a.behav_imp_weight_cap, num_tokens=n)


def _naive(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return naive_ppo_loss(theta, b.behav_logprobs, b.advantages, b.loss_mask, a.eps_clip, a.eps_clip_high,
                          num_tokens=n)


def _tis(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return tis_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, a.eps_clip, a.eps_clip_high,
                    a.tis_imp_weight_cap, num_tokens=n)


def _mis(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return mis_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, b.cu_seqlens, a.eps_clip,
                    a.eps_clip_high, a.mis_seq_ratio_low, a.mis_seq_ratio_high, num_tokens=n)


def _icepop(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return icepop_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, a.eps_clip, a.eps_clip_high,
                       a.icepop_ratio_low, a.icepop_ratio_high, num_tokens=n)


def _m2po(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return m2po_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, a.eps_clip, a.eps_clip_high,
                     a.m2po_m2_threshold, num_tokens=n)


def _gspo(theta: Tensor, prox: Tensor, b: LossBatch, a: AlgoConfig, n: int):
    return gspo_loss(theta, prox, b.behav_logprobs, b.advantages, b.loss_mask, b.cu_seqlens, a.gspo_eps_clip,
                     a.gspo_eps_clip_high, a.behav_imp_weight_cap, num_tokens=n)


OBJECTIVES: dict[str, Objective] = {
    "decoupled": Objective(_decoupled, needs_prox=True),
    "naive": Objective(_naive, needs_prox=False),
    "tis": Objective(_tis, needs_prox=True, stat_keys=("tis_truncated_ratio",)),
    "mis": Objective(_mis, needs_prox=True, stat_keys=("mis_masked_ratio",)),
    "icepop": Objective(_icepop, needs_prox=True, stat_keys=("icepop_masked_ratio",)),
    "m2po": Objective(_m2po, needs_prox=True, stat_keys=("m2po_masked_ratio", "m2po_m2")),
    "gspo": Objective(_gspo, needs_prox=True),
}
