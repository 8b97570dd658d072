"""Training FLOPs of a decoder-only LM, full fine-tuning or LoRA: the numerator of an honest MFU.

Pure integer arithmetic over a ``DecoderShape``; no model is built. One token of a decoder with
N parameters that multiply activations costs 2·N FLOPs forward (one multiply and one add per
weight), 2·N backward for the activation gradients and 2·N backward for the weight gradients:
the standard 6·N rule (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1;
Chowdhery et al. 2022, PaLM, appendix B). Attention adds, per layer and per attended (query,
key) pair, 2·H·D for QKᵀ and 2·H·D for the weighted sum of V forward (H query heads of dimension
D; grouped K/V heads change memory, not these FLOPs) and twice that backward (PaLM appendix B's
``12·L·H·Q·T`` per token for a full, non-causal window T):

    full fine-tune:  F = 6·N·T_fwd + 12·layers·H·D·pairs
    LoRA:            F = (4·N_base + 6·N_adapter)·T_fwd + 12·layers·H·D·pairs

LoRA freezes the base weights: no weight gradients for them, so a base weight costs 2·N forward
plus 2·N for the activation gradients that must still flow through it to the adapters below, 4·N
instead of 6·N. The adapters (``A: r×in``, ``B: out×r`` per adapted linear, ``N_adapter = Σ
r·(in + out)``) are trained: 6·N_adapter. Attention has no weights, so its backward is twice its
forward either way.

What counts (the house convention of ``tools/bench_gpu_trainer.py``: model FLOPs of the tokens
actually run; padding and recomputation are not counted):

- ``N``: every parameter except an untied input embedding (a lookup, no multiply); a tied
  embedding is counted once, as the LM head's matmul. Norm weights are counted as matmul weights
  (0.003 % of Qwen3-8B: below the rounding of any MFU).
- ``T_fwd``: tokens put through the model (``train/forward_tokens``: a shared prompt once).
- ``pairs``: causal (query, key) pairs, ``L²/2`` for a sequence of L tokens (the ``L``
  diagonal pairs are dropped, as in ``6·layers·H·D·Σ L²``); a prompt of P tokens shared by k
  responses of R_i tokens: ``P²/2 + Σ_i (R_i·P + R_i²/2)`` (``shared_prompt_pairs``).

Simplifications, each an over-count of a few per mille at most: LoRA's first layer needs no
activation gradient of its input (the embedding is frozen), counted anyway; LoRA dropout and the
``alpha / r`` scaling are elementwise, not counted; neither is the softmax, the norms' arithmetic,
the rotary embedding or the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Qwen3 / Llama decoder layer, by their Hugging Face names."""


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """A Qwen3-style decoder (GQA attention with q/k RMSNorm, SwiGLU MLP, no biases).

    ``qk_norm``: Qwen3's per-head RMSNorm on queries and keys (``head_dim`` weights each, per
    layer); Llama has none.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = True

    @classmethod
    def from_hf(cls, cfg) -> "DecoderShape":
        """From a transformers ``Qwen3Config`` / ``LlamaConfig`` (or anything with its fields)."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                   vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
                   qk_norm=getattr(cfg, "model_type", "qwen3") == "qwen3")

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each linear of one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def params(self) -> int:
        """All parameters, a tied embedding once (what ``model.parameters()`` counts)."""
        per_layer = sum(a * b for a, b in self.linear_dims().values()) + 2 * self.hidden
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + self.hidden + embeddings

    def matmul_params(self) -> int:
        """``N`` of the 6·N rule: ``params()`` less an untied input embedding (module docstring)."""
        return self.params() - (0 if self.tied else self.vocab * self.hidden)


def lora_params(shape: DecoderShape, rank: int, target_modules: str | Iterable[str] = "all-linear") -> int:
    """``N_adapter = layers · Σ r·(in + out)`` over the adapted linears of every decoder layer.

    ``target_modules``: names among ``LINEARS``, or ``"all-linear"`` (peft's shorthand: every
    linear but the LM head). A comma-separated string is read as a list.

    Raises:
        ValueError: ``rank < 1``, or a name that is not a decoder layer's linear.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank={rank} must be >= 1 (rank 0: no adapter, use the full fine-tune formula)")
    names = _targets(target_modules)
    dims = shape.linear_dims()
    return shape.layers * sum(rank * sum(dims[n]) for n in names)


def _targets(target_modules: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(target_modules, str):
        names = LINEARS if target_modules == "all-linear" else tuple(
            n.strip() for n in target_modules.split(",") if n.strip())
    else:
        names = tuple(target_modules)
    unknown = sorted(set(names) - set(LINEARS))
    if unknown or not names:
        raise ValueError(f"LoRA target_modules {list(names)}: {unknown or 'none given'} not among a decoder "
                         f"layer's linears {list(LINEARS)}; name some of them, or 'all-linear'")
    return tuple(dict.fromkeys(names))


def causal_pairs(lengths: Iterable[int]) -> float:
    """Σ L²/2: the (query, key) pairs of independent causal sequences of ``lengths`` tokens."""
    return sum(n * n for n in lengths) / 2


def shared_prompt_pairs(prompt_len: int, response_lens: Sequence[int]) -> float:
    """Pairs of a group forwarded as a prefix tree: its prompt once (``P²/2``), then each response
    over the prompt and its own earlier tokens (``R·P + R²/2``)."""
    p = prompt_len
    return p * p / 2 + sum(r * p + r * r / 2 for r in response_lens)


def train_flops(shape: DecoderShape, forward_tokens: int, pairs: float, adapter_params: int = 0) -> float:
    """FLOPs of one forward and backward (module docstring's formula).

    Args:
        shape: the decoder.
        forward_tokens: tokens put through the model.
        pairs: causal (query, key) pairs attended (``causal_pairs`` / ``shared_prompt_pairs``).
        adapter_params: ``N_adapter`` (``lora_params``); 0: full fine-tuning, 6·N.
    """
    assert forward_tokens >= 0 and pairs >= 0 and adapter_params >= 0, (forward_tokens, pairs, adapter_params)
    n = shape.matmul_params()
    dense = 6 * n if adapter_params == 0 else 4 * n + 6 * adapter_params
    return dense * forward_tokens + 12 * shape.layers * shape.heads * shape.head_dim * pairs


def train_flops_per_token(shape: DecoderShape, seq_len: int, adapter_params: int = 0) -> float:
    """FLOPs per token of a batch of independent causal sequences of ``seq_len`` tokens (the
    per-token figure papers quote: ``6·N + 6·layers·H·D·L`` for full fine-tuning)."""
    return train_flops(shape, seq_len, causal_pairs([seq_len]), adapter_params) / seq_len
