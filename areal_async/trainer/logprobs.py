"""Per-token log-probs and entropy of a packed micro-batch, computed in chunks over tokens.

The model runs once to the final hidden states ``[T, hidden]``; the LM head, the temperature and
the log-softmax are then applied to ``chunk_tokens`` rows at a time. With gradients enabled each
chunk is wrapped in activation checkpointing, so neither the forward nor the autograd graph ever
holds more than one ``[chunk_tokens, vocab]`` fp32 block (the full ``[T, vocab]`` logits dominate
trainer memory otherwise; see GPU_NOTES).

Alignment: position ``t`` predicts token ``t+1``. ``logp[t] = log softmax(logits_t / τ)[ids[t+1]]``;
the last position of every sequence has no next token in that sequence and gets ``logp = 0``.
The temperature τ is the rollout's (``rollout.temperature``; τ = 0, greedy, uses τ = 1), matching
the log-prob the inference server returns for the sampled token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from areal_async.trainer.attention import packed_kwargs
from areal_async.trainer.packing import PackedBatch


def _head_logp(lm_head: torch.nn.Module, hidden: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """One chunk: ``hidden [C, H]``, ``labels [C]`` → ``(logp [C] fp32, entropy [C] fp32)``."""
    logits = lm_head(hidden).float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def next_token_labels(batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """``(labels [T] int64, valid [T] bool)``: ``labels[t] = ids[t+1]``, invalid at sequence ends."""
    labels = torch.roll(batch.input_ids, -1)
    valid = torch.ones_like(batch.input_ids, dtype=torch.bool)
    valid[batch.cu_seqlens[1:].long() - 1] = False
    return labels, valid


class PackedPolicy(torch.nn.Module):
    """An HF causal LM whose ``forward`` returns chunked next-token log-probs of a packed row.

    The forward is a module's so that FSDP2 (``fully_shard`` on this wrapper as the root) gathers
    the root parameters (embeddings, final norm, LM head) around the whole computation, including
    the chunked head that bypasses the HF model's own ``forward``. ``self.lm`` is the HF model:
    its decoder is ``lm.model`` and its head ``lm.lm_head`` (Llama/Qwen families).
    ``autocast_dtype`` (e.g. bf16) runs the forward under ``torch.autocast`` (mixed precision
    without FSDP2; FSDP2 casts parameters itself).
    """

    def __init__(self, lm: torch.nn.Module, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.lm = lm
        self.autocast_dtype = autocast_dtype

    def forward(self, batch: PackedBatch, temperature: float = 1.0, chunk_tokens: int = 1024) -> tuple[Tensor, Tensor]:
        """See ``packed_logprobs``."""
        if self.autocast_dtype is not None:
            with torch.autocast(batch.input_ids.device.type, dtype=self.autocast_dtype):
                return self._forward(batch, temperature, chunk_tokens)
        return self._forward(batch, temperature, chunk_tokens)

    def _forward(self, batch: PackedBatch, temperature: float, chunk_tokens: int) -> tuple[Tensor, Tensor]:
        assert temperature >= 0, f"temperature must be >= 0, got {temperature}"
        assert chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {chunk_tokens}"
        temperature = temperature if temperature > 0 else 1.0
        out = self.lm.model(
            input_ids=batch.input_ids[None],
            position_ids=batch.position_ids[None],
            use_cache=False,
            **packed_kwargs(batch.cu_seqlens, batch.max_seqlen),
        )
        hidden = out.last_hidden_state[0]  # [T, hidden]
        labels, valid = next_token_labels(batch)
        logps, entropies = [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_head_logp, self.lm.lm_head, h, y, temperature, use_reentrant=False)
            else:
                lp, ent = _head_logp(self.lm.lm_head, h, y, temperature)
            logps.append(lp)
            entropies.append(ent)
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def packed_logprobs(
    policy: PackedPolicy,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of each next token under the policy at ``temperature``, plus entropy.

    Args:
        policy: a ``PackedPolicy`` (possibly FSDP-sharded) whose HF model uses the ``"packed"``
            attention (``use_packed_attention``).
        batch: the packed micro-batch, on the model's device.
        temperature: sampling temperature τ ≥ 0 of the rollout (0 ⇒ 1).
        chunk_tokens: rows of the ``[T, vocab]`` logits materialised at once.

    Returns:
        ``(logp, entropy)``, both ``[T] float32``; ``logp`` carries gradients when grad is
        enabled, ``entropy`` (of the temperature-scaled distribution, nats) never does. Both are
        0 at the last position of each sequence.
    """
    return policy(batch, temperature, chunk_tokens)
