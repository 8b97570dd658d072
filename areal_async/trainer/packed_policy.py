"""Per-token log-probs and entropy of a packed micro-batch, computed in chunks over tokens.

The model runs once to the hidden states ``[T, hidden]``; the LM head, the temperature and the
log-softmax then take ``chunk_tokens`` rows at a time (one ``[chunk_tokens, vocab]`` fp32 block
alive). **fused**, the default for a plain bias-free ``nn.Linear`` head: one autograd function that
keeps only ``lse [T] fp32`` and recomputes each chunk's logits in the backward. **checkpointed**:
when the head's ``forward`` was replaced (deterministic mode), has a bias, or ``fused_head=False``.
Only the batch's ``head_rows`` go through the head, scattered into the unshared ``[T]`` layout (0
elsewhere). ``logp[t] = log softmax(logits_t / τ)[ids[t+1]]``, 0 at each sequence's last position;
τ = ``rollout.temperature`` (0, greedy, uses 1), as the server's log-prob of the sampled token.
Derivation, checks, why deterministic mode is checkpointed: docs/trainer.md, "LM head and compilation".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from areal_async.trainer.packing import PackedBatch
from areal_async.trainer.tree import TreeBatch


def _head_logp(lm_head: torch.nn.Module, hidden: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """One chunk: ``hidden [C, H]``, ``labels [C]`` → ``(logp [C] fp32, entropy [C] fp32)``."""
    logits = lm_head(hidden).float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _chunk_stats(logits: Tensor, y: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of the fused head: raw ``logits = h wᵀ [C, V]`` (compute dtype), ``y [C]`` →
    ``(logp, entropy, lse)``, each ``[C] fp32``; ``z = logits/τ`` in fp32 (fp64 for fp64 inputs),
    ``lse = logsumexp z``."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # kept logits stay intact
    if temperature != 1.0:
        z.div_(temperature)
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, y[:, None])[:, 0] - lse
    x = z.sub_(lse[:, None])  # log-softmax, in place
    entropy = -x.exp().mul_(x).sum(-1)
    return logp, entropy, lse


def _chunk_grad_logits(logits: Tensor, y: Tensor, lse: Tensor, g: Tensor, temperature: float) -> Tensor:
    """Gradient of ``Σ_t g_t · logp_t`` with respect to the chunk's raw logits ``h wᵀ`` ``[C, V]``
    (in ``logits``' dtype). With ``z = logits/τ`` and ``logp_t = z_{t,y_t} − logsumexp_j z_{t,j}``:
    ``∂logp_t/∂(h wᵀ)_{t,j} = (1[j = y_t] − softmax(z_t)_j) / τ``."""
    z = logits.to(lse.dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    coef = g / temperature  # [C]
    grad = z.sub_(lse[:, None]).exp_().mul_(-coef[:, None])  # −p · g/τ, in place
    # + g/τ at the label; one label per row, so a plain scatter (deterministic on CUDA) suffices
    grad.scatter_(-1, y[:, None], grad.gather(-1, y[:, None]) + coef[:, None])
    return grad.to(logits.dtype)


class _HeadKernels(NamedTuple):
    stats: Callable
    grad_logits: Callable


_EAGER_KERNELS = _HeadKernels(_chunk_stats, _chunk_grad_logits)


class _FusedHeadLogp(torch.autograd.Function):
    """``(hidden [T, H], weight [V, H]) → (logp [T] fp32, entropy [T] fp32)`` chunk by chunk;
    saves ``lse [T] fp32`` only (see the module docstring). ``weight``'s gradient is accumulated
    over chunks in ``dtype`` with ``addmm_`` (as autograd sums the per-chunk gradients of the
    checkpointed path); ``entropy`` is not differentiable."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk_tokens: int,
                dtype: torch.dtype, kernels: _HeadKernels) -> tuple[Tensor, Tensor]:
        h, w = hidden.to(dtype), weight.to(dtype)
        n = h.shape[0]
        acc = torch.promote_types(dtype, torch.float32)
        logp, entropy, lse = (torch.empty(n, dtype=acc, device=h.device) for _ in range(3))
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            logp[s:e], entropy[s:e], lse[s:e] = kernels.stats(F.linear(h[s:e], w), labels[s:e], temperature)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype, ctx.kernels = temperature, chunk_tokens, dtype, kernels
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if grad_logp is None or not (need_h or need_w):
            return (None,) * 7
        h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        g = grad_logp.to(lse.dtype)
        n, step = h.shape[0], ctx.chunk_tokens
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, step):
                e = min(s + step, n)
                grad_z = ctx.kernels.grad_logits(F.linear(h[s:e], w), labels[s:e], lse[s:e], g[s:e],
                                                 ctx.temperature)
                if need_h:
                    torch.mm(grad_z, w, out=grad_h[s:e])
                if need_w:
                    grad_w.addmm_(grad_z.t(), h[s:e])
        grad_h = grad_h.to(hidden.dtype) if need_h else None
        grad_w = grad_w.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None, None


def _fusable(head: torch.nn.Module) -> bool:
    """A bias-free ``nn.Linear`` whose ``forward`` is the class's own (not replaced by tiling)."""
    return isinstance(head, torch.nn.Linear) and head.bias is None and "forward" not in vars(head)


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
    without FSDP2; FSDP2 casts parameters itself). ``fused_head``: use the fused head when the LM
    head allows it (see the module docstring); ``compile_head``: compile its per-chunk kernels.
    """

    def __init__(self, lm: torch.nn.Module, autocast_dtype: torch.dtype | None = None,
                 fused_head: bool = True, compile_head: bool = False):
        super().__init__()
        self.lm = lm
        self.autocast_dtype = autocast_dtype
        self.fused_head = fused_head
        self.head_kernels = _EAGER_KERNELS
        if compile_head:
            self.head_kernels = _HeadKernels(torch.compile(_chunk_stats), torch.compile(_chunk_grad_logits))

    def forward(self, batch: PackedBatch | TreeBatch, temperature: float = 1.0, chunk_tokens: int = 1024) -> tuple[Tensor, Tensor]:
        """See ``packed_logprobs``."""
        if self.autocast_dtype is not None:
            with torch.autocast(batch.input_ids.device.type, dtype=self.autocast_dtype):
                return self._forward(batch, temperature, chunk_tokens)
        return self._forward(batch, temperature, chunk_tokens)

    def _forward(self, batch: PackedBatch | TreeBatch, temperature: float, chunk_tokens: int) -> tuple[Tensor, Tensor]:
        assert temperature >= 0, f"temperature must be >= 0, got {temperature}"
        assert chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {chunk_tokens}"
        temperature = temperature if temperature > 0 else 1.0
        hidden = self.lm.model(use_cache=False, **batch.model_inputs()).last_hidden_state[0]  # [N, hidden]
        rows, labels, out_index, out_len = batch.head_rows()
        if rows is not None:  # only the rows that carry a loss token go through the head
            hidden = hidden.index_select(0, rows)
        head = self.lm.lm_head
        if self.fused_head and _fusable(head):
            device_type = hidden.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
            logp, entropy = _FusedHeadLogp.apply(hidden, head.weight, labels, temperature, chunk_tokens, dtype,
                                                 self.head_kernels)
        else:
            logp, entropy = self._checkpointed_head(hidden, labels, temperature, chunk_tokens)
        if out_index is None:
            _, valid = next_token_labels(batch)
            zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
            return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)
        full = logp.new_zeros(out_len)
        return full.index_copy(0, out_index, logp), full.index_copy(0, out_index, entropy)

    def _checkpointed_head(self, hidden: Tensor, labels: Tensor, temperature: float,
                           chunk_tokens: int) -> tuple[Tensor, Tensor]:
        logps, entropies = [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_head_logp, self.lm.lm_head, h, y, temperature, use_reentrant=False)
            else:
                lp, ent = _head_logp(self.lm.lm_head, h, y, temperature)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies)


def packed_logprobs(
    policy: PackedPolicy,
    batch: PackedBatch | TreeBatch,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of each next token under the policy at ``temperature``, plus entropy.

    Args:
        policy: a ``PackedPolicy`` (possibly FSDP-sharded) whose HF model uses the ``"packed"``
            attention (``use_packed_attention``).
        batch: the packed micro-batch, on the model's device: a ``PackedBatch`` (sequences back
            to back) or a ``TreeBatch`` (shared prefixes forwarded once, ``trainer/tree.py``).
            Either may name the positions whose log-prob is wanted (``head_index``): only those
            rows go through the LM head.
        temperature: sampling temperature τ ≥ 0 of the rollout (0 ⇒ 1).
        chunk_tokens: rows of the ``[T, vocab]`` logits materialised at once.

    Returns:
        ``(logp, entropy)``, both ``[T] float32``; ``logp`` carries gradients when grad is
        enabled, ``entropy`` (of the temperature-scaled distribution, nats) never does. ``T`` is
        the unshared layout's length (Σ sequence lengths, also for a ``TreeBatch``). Both are 0
        at the last position of each sequence and, with ``head_index``, at every position not in
        it.
    """
    return policy(batch, temperature, chunk_tokens)
