"""A lean batched forward pass over an HF Llama-family / Qwen3 model's own modules and weights.

``BatchedForward`` leaves the HF model the owner of the parameters (updated by HF name, e.g.
``model.layers.0.self_attn.q_proj.weight``): ``q|k|v`` and ``gate|up`` are fused once and the HF
parameters re-pointed to views of the fused tensors, so an in-place update lands in them.
``prefill`` packs new prompts into one token row; ``decode_batch`` runs one token per running
slot, as a CUDA graph replay on CUDA. Each phase's kernels are chosen once (``kernels.py``). Logits
come only for positions that sample, in float32; with ``batch_invariant=True`` they are bitwise
independent of the batch. Not supported: sliding-window attention, MoE, a bias on ``o_proj``.
How each path works: docs/engine.md#how-it-works.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .cuda_graph import DecodeGraphs, decode_bucket, padded_inputs
from .kernels import KernelPlan, Linear, plan_kernels
from .kv_cache import KVCache
from .triton_decode_attention import decode_attention, triton
from .triton_fused import add_rms_norm, qkv_rope_store, silu_mul


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``linears``' weights (and biases) and re-point each to a view of the result."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "cannot fuse projections where only some have a bias"
    bias = torch.cat([lin.bias.detach() for lin in linears]).contiguous() if all(has_bias) else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class _RMSNorm:
    """An HF RMSNorm module; on CUDA one fused ``F.rms_norm`` launch with its weight and epsilon
    (chosen once, from where the weight lives: the forward never moves it)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.eps = getattr(module, "variance_epsilon", None)
        self.fused = module.weight.is_cuda and self.eps is not None

    @property
    def params(self) -> tuple[torch.Tensor, float]:
        """(weight, epsilon), read at call time (weight updates copy into the same tensor)."""
        return self.module.weight, self.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.module.weight, self.eps)
        return self.module(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """One decoder layer's modules and fused weights."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _RMSNorm(layer.input_layernorm)
        self.post_norm = _RMSNorm(layer.post_attention_layernorm)
        self.q_norm = _RMSNorm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _RMSNorm(attn.k_norm) if hasattr(attn, "k_norm") else None
        self.qkv_w, self.qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_w, self.gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj])
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        assert attn.o_proj.bias is None, "o_proj bias is not supported"


class BatchedForward:
    """Prefill and decode for ``max_slots`` concurrent sequences of up to ``max_seq_len`` tokens.

    Args:
        model: an HF ``*ForCausalLM`` (Llama family or Qwen3), in eval mode, on its device.
        max_slots: KV-cache slots (the most requests running at once).
        max_seq_len: prompt + output tokens per request.
        batch_invariant: compute so that each request's logits do not depend on the batch (slower).
        cuda_graph: on CUDA, replay captured decode graphs (``False``: eager decode, SGLang's
            ``--disable-cuda-graph``); ignored on CPU.
        prefix_rows: extra KV rows for the prefix cache (``KVCache.prefix_rows``).

    Attributes:
        kernels: the ``KernelPlan`` chosen from device, dtype, mode, head dim and model config.
        graphs: the ``DecodeGraphs`` replaying ``_decode_step`` (CUDA with ``cuda_graph``), else ``None``.
        cache: the slot ``KVCache``.
    """

    def __init__(self, model: nn.Module, max_slots: int, max_seq_len: int, batch_invariant: bool = False,
                 cuda_graph: bool = True, prefix_rows: int = 0):
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "num_experts", 0):
            raise ValueError(f"model type '{cfg.model_type}' uses sliding windows or experts; not supported")
        self.model = model
        self.batch_invariant = batch_invariant
        core = model.model
        self.embed, self.final_norm, self.lm_head = core.embed_tokens, _RMSNorm(core.norm), model.lm_head
        self.layers = [_Layer(layer) for layer in core.layers]
        attn = core.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        with torch.no_grad():
            positions = torch.arange(max_seq_len, device=self.device)[None]
            cos, sin = core.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [L, D] in the model dtype, as HF applies them
        norms = [self.final_norm] + [n for la in self.layers for n in (la.input_norm, la.post_norm, la.q_norm, la.k_norm)]
        fusable = (getattr(cfg, "hidden_act", None) in ("silu", "swish")  # the fused kernels' SiLU, norms and RoPE
                   and all(n is None or n.eps is not None for n in norms) and self.cos.shape[-1] == self.head_dim)
        self.kernels: KernelPlan = plan_kernels(self.device.type, self.dtype, batch_invariant, self.head_dim,
                                                triton_available=triton is not None, fusable_layers=fusable,
                                                cuda_graph=cuda_graph)
        self.cache = KVCache(len(self.layers), max_slots, self.num_kv_heads, max_seq_len, self.head_dim, self.dtype,
                             self.device, keys_transposed=self.kernels.decode_attention != "triton",
                             prefix_rows=prefix_rows)
        self.graphs = (DecodeGraphs(self._decode_step, self.cache, self.embed.weight.shape[0], self.device)
                       if self.kernels.cuda_graph else None)

    def _qkv(self, linear: Linear, layer: _Layer, h: torch.Tensor, positions: torch.Tensor):
        """Projections, q/k norms and RoPE for ``h: [T, hidden]`` → q ``[T, H, D]``, k, v ``[T, Hkv, D]``."""
        qkv = linear(h, layer.qkv_w, layer.qkv_b)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :nq].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, nq : nq + nkv].view(-1, self.num_kv_heads, self.head_dim)
        v = qkv[:, nq + nkv :].view(-1, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _mlp(self, linear: Linear, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(layer.post_norm(x), layer.gate_up_w, layer.gate_up_b)
        gate, up = gate_up.chunk(2, dim=-1)
        down = layer.down_proj
        return x + linear(layer.act(gate) * up, down.weight, down.bias)

    def _logits(self, linear: Linear, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._head(linear, self.final_norm(h), out)

    def _head(self, linear: Linear, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM head over final-normed ``h``: float32 logits, or into ``out`` (the graphs' buffer)."""
        logits = linear(h, self.lm_head.weight, self.lm_head.bias)
        return logits.float() if out is None else out.copy_(logits)

    def _prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                           starts: list[int], slots: list[int], cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """Causal attention within each packed prompt: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` → ``[T, H*D]``.

        Sequence i's ``lengths[i]`` rows are its positions ``starts[i] ..``; a sequence with
        ``starts[i] > 0`` attends to its slot's cached keys and values of positions
        ``[0, starts[i] + lengths[i])`` (the reused prefix and its own, already stored)."""
        if cu_seqlens is not None:  # CUDA half precision, no cached prefix: one flash varlen call
            from torch.nn.attention.varlen import varlen_attn

            groups = self.num_heads // self.num_kv_heads
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            n = max(lengths)
            o = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, n, n, scale=self.scaling, window_size=(-1, 0))
            return o.reshape(q.shape[0], -1)
        outs, row = [], 0
        for n, start, slot in zip(lengths, starts, slots):  # attention never crosses sequences
            qi = q[row : row + n].transpose(0, 1)[None]
            if start == 0:
                ki, vi = (t[row : row + n].transpose(0, 1)[None] for t in (k, v))
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scaling, enable_gqa=True)
            else:  # query j (position start + j) sees cached positions 0 .. start + j
                ki, vi = (t.contiguous()[None] for t in self.cache.row(layer, slot, start + n))
                visible = (torch.arange(start + n, device=q.device)[None, :]
                           <= torch.arange(start, start + n, device=q.device)[:, None])
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=visible, scale=self.scaling, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            row += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], slots: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """Run prompts, fill their KV slots, return last-position logits ``[n, V] float32``.

        Args:
            seqs: n token lists (each non-empty, ≤ ``max_seq_len``).
            slots: the KV slot of each sequence.
            starts: per sequence, how many of its first positions its slot already holds (a
                prefix copied from the prefix cache, ``0 <= start < len``): only the rest runs.
                ``None``: all 0. Not in batch-invariant mode (a cached prefix changes the
                attention's shapes, so a result would depend on what happened to be cached).
        """
        starts = [0] * len(seqs) if starts is None else starts
        assert all(0 <= st < len(s) for s, st in zip(seqs, starts)), f"bad prefill starts {starts}"
        assert not (self.batch_invariant and any(starts)), "a cached prefix in batch-invariant mode"
        lengths = [len(s) - st for s, st in zip(seqs, starts)]
        # built on the host, copied without waiting for the device (a decode step may be running)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        host = torch.stack([
            torch.tensor([t for s, st in zip(seqs, starts) for t in s[st:]], dtype=torch.int64),
            torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lengths)]),
            torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(lengths)),
        ])
        tokens, positions, slot_of = host.to(self.device, non_blocking=True)
        varlen = self.kernels.prefill_attention == "varlen" and not any(starts)
        cu_seqlens = cu.to(torch.int32).to(self.device, non_blocking=True) if varlen else None
        last = (cu[1:] - 1).to(self.device, non_blocking=True)
        attend = functools.partial(self._prefill_attention, lengths=lengths, starts=starts, slots=slots,
                                   cu_seqlens=cu_seqlens)
        linear = self.kernels.prefill_linear
        if self.kernels.fused_layers:
            return self._prefill_fused(linear, tokens, positions, slot_of, attend, last)
        index = self.cache.token_index(slot_of, positions)
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(linear, layer, layer.input_norm(x), positions)
            self.cache.write(i, index, k, v)
            x = x + linear(attend(i, q, k, v), layer.o_proj.weight)
            x = self._mlp(linear, layer, x)
        return self._logits(linear, x[last])

    def _qkv_fused(self, linear: Linear, layer: _Layer, i: int, h: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, kv_out: bool = False):
        """Projection, then q/k norms, RoPE and the cache store in one kernel (``triton_fused.py``)."""
        qkv = linear(h, layer.qkv_w, layer.qkv_b)
        q_norm = layer.q_norm.params if layer.q_norm is not None else None
        k_norm = layer.k_norm.params if layer.k_norm is not None else None
        return qkv_rope_store(qkv, positions, slots, self.cos, self.sin, q_norm, k_norm, self.cache.k[i],
                              self.cache.v[i], self.num_heads, kv_out=kv_out)

    def _mlp_fused(self, linear: Linear, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) · up)`` of the post-attention-normed ``h`` (the residual add is the caller's)."""
        down = layer.down_proj
        return linear(silu_mul(linear(h, layer.gate_up_w, layer.gate_up_b)), down.weight, down.bias)

    def _prefill_fused(self, linear: Linear, tokens, positions, slot_of, attend, last) -> torch.Tensor:
        """``prefill`` on CUDA with the fused element-wise kernels (same inputs, same result up to rounding)."""
        x, delta = self.embed(tokens), None
        for i, layer in enumerate(self.layers):
            h = add_rms_norm(x, delta, *layer.input_norm.params)
            q, k, v = self._qkv_fused(linear, layer, i, h, positions, slot_of, kv_out=True)
            attn = linear(attend(i, q, k, v), layer.o_proj.weight)
            delta = self._mlp_fused(linear, layer, add_rms_norm(x, attn, *layer.post_norm.params))
        return self._head(linear, add_rms_norm(x[last], delta[last], *self.final_norm.params))

    def decode_shape(self, batch: int, span: int) -> tuple[int, int]:
        """(rows, attention length) a decode step of ``batch`` running slots, the longest holding
        ``span`` positions after the step, runs with. On CUDA the same with or without graphs, so
        eager steps (``cuda_graph=False``) compute exactly what the replayed graphs compute."""
        if self.kernels.fixed_shape:
            return self.cache.num_slots, self.cache.max_seq_len
        if self.device.type == "cuda":
            rows, length = decode_bucket(self.cache.num_slots, self.cache.max_seq_len, batch, span)
            # the fused kernel bounds its loop by each row's own position: one graph per row count
            return rows, self.cache.max_seq_len if self.kernels.decode_attention == "triton" else length
        return batch, self.cache.max_seq_len if self.kernels.full_span else span

    @torch.inference_mode()
    def decode_batch(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One decode step for the running slots ``0..n-1`` (the engine's entry point). Waits for
        nothing on CUDA: the tokens may be the output of a sampling step still in the stream.

        Args:
            tokens: ``[n] int64`` on the model's device, the last sampled token of each running slot.
            positions: n ints, its absolute position (= tokens already in the slot's cache).
        Returns:
            next-token logits ``[n, V] float32``; on CUDA a view of a buffer that the next step
            overwrites.
        """
        n = len(positions)
        assert tokens.shape == (n,), f"{tokens.shape[0]} tokens for {n} positions"
        rows, length = self.decode_shape(n, max(positions) + 1)
        if self.graphs is not None:
            return self.graphs.run(tokens, positions, rows, length)
        inputs = torch.empty(3, rows, dtype=torch.int64, device=self.device)
        padded_inputs(tokens, positions, rows, self.cache.scratch_slot, inputs)
        return self._decode_step(inputs[0], inputs[1], inputs[2], length)[:n]

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, length: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The eager decode step: rows ``b`` (``tokens, positions, slots: [B] int64`` on the device)
        read slot ``b``'s cache and write ``slots[b]`` (``b`` itself, or the scratch slot for a
        padding row); attention over positions ``[0, length)``. Returns logits ``[B, V] float32``
        (into ``out`` when given: the graphs' buffer). No host syncs: this is what ``DecodeGraphs``
        captures."""
        batch = tokens.shape[0]
        linear = self.kernels.decode_linear
        if self.kernels.fused_layers:
            return self._decode_fused(linear, tokens, positions, slots, out)
        triton_attention = self.kernels.decode_attention == "triton"
        groups = self.num_heads // self.num_kv_heads
        index = self.cache.token_index(slots, positions)
        if not triton_attention:
            # [B, 1, 1, length] additive mask: row b sees its own positions 0..positions[b]
            hidden = torch.arange(length, device=self.device)[None, :] > positions[:, None]
            bias = torch.zeros(hidden.shape, dtype=torch.float32, device=self.device).masked_fill_(hidden, float("-inf"))
            bias = bias[:, None, None, :]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(linear, layer, layer.input_norm(x), positions)
            self.cache.write(i, index, k, v)
            if triton_attention:  # CUDA: one Triton kernel, reads only each row's positions
                o = decode_attention(q, self.cache.k[i], self.cache.v[i], positions, self.scaling)
            else:
                keys_t, values = self.cache.view(i, batch, length)  # [B, Hkv, D, length], [B, Hkv, length, D]
                # grouped-query attention without repeating K/V: [B, Hkv, G, D] @ [B, Hkv, D, length]
                scores = torch.matmul(q.view(batch, self.num_kv_heads, groups, self.head_dim), keys_t)
                probs = torch.softmax(scores.float() * self.scaling + bias, dim=-1).to(values.dtype)
                o = torch.matmul(probs, values)  # [B, Hkv, G, D]
            x = x + linear(o.reshape(batch, -1), layer.o_proj.weight)
            x = self._mlp(linear, layer, x)
        return self._logits(linear, x, out)

    def _decode_fused(self, linear: Linear, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      out: torch.Tensor | None) -> torch.Tensor:
        """``_decode_step`` on CUDA: 9 launches per layer (4 GEMMs, attention, 4 fused element-wise)."""
        x, delta = self.embed(tokens), None
        for i, layer in enumerate(self.layers):
            h = add_rms_norm(x, delta, *layer.input_norm.params)
            q = self._qkv_fused(linear, layer, i, h, positions, slots)
            o = decode_attention(q, self.cache.k[i], self.cache.v[i], positions, self.scaling)
            attn = linear(o.reshape(tokens.shape[0], -1), layer.o_proj.weight)
            delta = self._mlp_fused(linear, layer, add_rms_norm(x, attn, *layer.post_norm.params))
        return self._head(linear, add_rms_norm(x, delta, *self.final_norm.params), out)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """HF name → parameter/buffer, tied aliases included (``lm_head.weight``)."""
        named = dict(self.model.state_dict(keep_vars=True))
        named.update(dict(self.model.named_parameters(remove_duplicate=False)))
        return named

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (HF names) into the live parameters, cast to the model dtype.

        Raises:
            ValueError: an unknown name or a shape mismatch (nothing is copied then).
        """
        named = self.named_tensors()
        check_weight_names(named, {n: tuple(t.shape) for n, t in tensors.items()})
        for name, value in tensors.items():
            named[name].copy_(value.to(named[name].dtype))


def check_weight_names(named: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` if a name is unknown or its shape differs from the live parameter."""
    for name, shape in shapes.items():
        if name not in named:
            raise ValueError(f"unknown weight name '{name}' (expected HF parameter names like 'model.norm.weight')")
        if tuple(named[name].shape) != tuple(shape):
            raise ValueError(f"weight '{name}' has shape {list(shape)}, the model's is {list(named[name].shape)}")
