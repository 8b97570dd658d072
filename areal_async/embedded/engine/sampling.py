"""Seeded, batch-invariant token sampling (``sample``) and one request's ``SamplingParams``.

Gumbel-max (Gumbel 1954; Maddison et al. 2014): ``argmax(z + g)`` with ``z = logits / T``, top-k /
top-p filtered, draws from ``softmax(z)``; ``g`` is a pure function of (seed, absolute position,
vocab index) (``noise_hash.py``), so tokens ignore batch-mates and a resubmission continues exactly.
The log-prob returned is ``log_softmax(logits / T)`` over the whole vocabulary (what the trainer
recomputes), even after top-k / top-p; ``T == 0`` is greedy, with ``log_softmax(logits)``.
"""

from __future__ import annotations

import msgspec
import torch

from .noise_hash import gumbel_from_keys, noise_keys

GREEDY_BELOW = 1e-6  # temperatures below this sample greedily (SGLang 0.5.23's _SAMPLING_EPS)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling part of one ``/generate`` request, decoded (``request.decode_sampling``: SGLang
    field names, defaults and normalisation).

    ``top_k == -1`` means the whole vocabulary; ``temperature == 0`` is greedy; ``sampling_seed``
    ``None`` means "pick one at random" (unreproducible, as on SGLang without a seed).
    ``max_new_tokens == 0`` is a prefill-only request (no token). ``stop``: strings matched on the
    detokenized output (``stop.py``); ``stop_token_ids``: token ids that stop it, like EOS;
    ``ignore_eos`` turns both EOS and ``stop_token_ids`` off (SGLang's token-based finish), not
    ``stop``. ``min_new_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that many
    tokens (SGLang's min-new-tokens penalizer). ``no_stop_trim``: keep the matched stop in ``text``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: list[int] = []
    min_new_tokens: int = 0
    ignore_eos: bool = False
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def gumbel_argmax(z: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(z + gumbel_from_keys(keys, V), dim=-1)`` (first index on ties) as ``[R] int64``.

    On CUDA with Triton this is one fused kernel (``triton_sampling.py``) that never materialises
    the ``[R, V]`` noise; elsewhere the noise is built with torch ops. Both draw the same uniforms;
    the two ``log`` implementations may differ in the last bit, so a token can differ between the
    paths only at an exact near-tie.
    """
    if z.is_cuda:
        from .triton_sampling import fused_gumbel_argmax

        tokens = fused_gumbel_argmax(z, keys)
        if tokens is not None:
            return tokens
    return torch.argmax(z + gumbel_from_keys(keys, z.shape[-1]), dim=-1)


def _filter_top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` the entries of ``z [R, V]`` outside each row's top-k / top-p nucleus."""
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    rank = torch.arange(z.shape[-1], device=z.device)[None, :]
    k = torch.where(top_k > 0, top_k, z.shape[-1])[:, None]
    probs = torch.softmax(sorted_z, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # nucleus: keep while the mass before < p
    drop = (rank >= k) | ((mass_before >= top_p[:, None]) & (rank > 0))
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(-1, order, sorted_z)


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without waiting for the device's queue (the CPU tensor is staged at once)."""
    return x.to(device, non_blocking=True)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: list[int],
    positions: list[int],
    bans: list[tuple[int, list[int]]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its log-prob under ``log_softmax(logits / T)``.

    Args:
        logits: ``[B, V] float32`` next-token logits.
        temperature: ``[B] float32``; 0 ⇒ greedy.
        top_p: ``[B] float32`` in (0, 1]; top_k: ``[B] int64``, -1 ⇒ whole vocabulary.
        seeds, positions: B ints each — see ``noise_hash.gumbel_noise``.
        bans: ``(row, token ids)`` pairs: those tokens are not drawn in that row (``-inf`` before
            temperature, top-k and top-p, as SGLang's min-new-tokens penalizer does), while the
            returned log-prob stays that of the unmasked distribution, like top-k / top-p's.
    Returns:
        tokens ``[B] int64`` and logprobs ``[B] float32``, on ``logits``' device.

    Give ``temperature``, ``top_p`` and ``top_k`` as CPU tensors (the engine does): which rows are
    greedy or filtered is then decided on the host, and the only wait for the device is the
    caller's read of the result. On CUDA, when no row is top-k / top-p filtered, the whole draw is
    two fused kernels (``triton_sampling.fused_sample``; its docstring says how its rounding
    differs from the torch path's).
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32, f"logits must be [B, V] float32, got {logits.shape} {logits.dtype}"
    device = logits.device
    host_t, host_p, host_k = temperature.tolist(), top_p.tolist(), top_k.tolist()
    if logits.is_cuda and not bans and not any(k > 0 or p < 1.0 for k, p in zip(host_k, host_p)):
        from .triton_sampling import fused_sample

        drawn = fused_sample(logits, _to(temperature, device), _to(noise_keys(seeds, positions), device))
        if drawn is not None:
            return drawn
    rows = [b for b, t in enumerate(host_t) if t > 0]
    keys = _to(noise_keys([seeds[b] for b in rows], [positions[b] for b in rows]), device) if rows else None
    temperature = _to(temperature, device)
    z = logits / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(z, dim=-1)
    banned = None
    if bans:
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        for row, ids in bans:
            banned[row, ids] = True
        banned = _to(banned, device)
    if len(rows) < len(logits):  # some rows are greedy
        tokens = torch.argmax(logits if banned is None else logits.masked_fill(banned, float("-inf")), dim=-1)
    else:
        tokens = torch.empty(len(logits), dtype=torch.int64, device=device)
    if rows:
        every = len(rows) == len(logits)
        index = None if every else _to(torch.tensor(rows), device)
        zs = logprobs if every else logprobs[index]  # log_softmax(z) = z - const: same argmax, finite where z is
        if banned is not None:
            zs = zs.masked_fill(banned if every else banned[index], float("-inf"))
        filtered = [i for i, b in enumerate(rows) if host_k[b] > 0 or host_p[b] < 1.0]
        if filtered:
            zs = zs.clone() if every else zs
            sub, picked = _to(torch.tensor(filtered), device), [rows[i] for i in filtered]
            zs[sub] = _filter_top_k_top_p(zs[sub], _to(torch.tensor([host_k[b] for b in picked]), device),
                                          _to(torch.tensor([host_p[b] for b in picked], dtype=torch.float32), device))
        drawn = gumbel_argmax(zs, keys)
        if every:
            tokens = drawn
        else:
            tokens[index] = drawn
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
