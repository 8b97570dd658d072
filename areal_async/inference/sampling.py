"""Seeded, batch-invariant token sampling and the sampling parameters of one request.

A request's randomness is a pure function of ``(sampling_seed, absolute position, vocab index)``:
the Gumbel noise added to the scaled logits at position p is drawn from a fresh Mersenne-Twister
stream keyed by ``splitmix64(seed, p)``, entry i of the stream for vocab index i, never from a
generator shared across requests. So a
request's tokens do not depend on which other requests share its batch, and a request resubmitted
as prompt + partial output with the same seed continues exactly as it would have uninterrupted.

Sampling is Gumbel-max (Gumbel 1954; Maddison et al. 2014, "A* Sampling"): ``argmax(z + g)`` with
``z = logits / T`` (top-k / top-p filtered to ``-inf``) and ``g = -log(-log(u))`` draws exactly
from ``softmax(z)``. The returned log-prob is ``log_softmax(logits / T)`` of the chosen token over
the *whole* vocabulary — what the trainer recomputes at the rollout temperature — even when top-k /
top-p filtered the draw. ``T == 0`` is greedy and reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import msgspec
import torch

_MASK64 = (1 << 64) - 1

# SGLang sampling fields this engine accepts only at their neutral value.
_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "stop": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
}
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params"}


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling part of a ``/generate`` request (SGLang field names and defaults).

    ``top_k == -1`` means the whole vocabulary; ``sampling_seed`` ``None`` means "pick one at
    random" (unreproducible, as on SGLang without a seed).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True

    @classmethod
    def parse(cls, raw: dict | None) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` dict.

        Raises:
            ValueError: unknown field, unsupported non-neutral field, or out-of-range value; the
                message names the field and the accepted range.
        """
        raw = dict(raw or {})
        for key, neutral in _NEUTRAL.items():
            value = raw.pop(key, neutral)
            if value not in (neutral, None, [], ""):
                raise ValueError(f"sampling_params.{key}={value!r} is not supported; leave it at {neutral!r}")
        known = {f.name for f in msgspec.structs.fields(cls)}
        for key in list(raw):
            if key in _IGNORED and key not in known:
                raw.pop(key)
            elif key not in known:
                raise ValueError(f"unknown sampling_params field '{key}'; known fields: {sorted(known)}")
        if raw.get("top_k") is None:
            raw.pop("top_k", None)
        try:
            params = msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid sampling_params: {exc}") from None
        if params.max_new_tokens <= 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        if params.top_k == 0 or params.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (all) or >= 1, got {params.top_k}")
        return params


def _splitmix64(x: int) -> int:
    """splitmix64 (Steele et al. 2014) of a Python int, as an unsigned 64-bit int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise row drawn for ``position`` of a request seeded ``seed``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def gumbel_noise(seeds: list[int], positions: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise that is a pure function of (seed, position, vocab index).

    Row b is the first ``vocab`` draws of a Mersenne-Twister stream seeded with
    ``noise_key(seeds[b], positions[b])`` (uniforms clamped to ``[2**-25, 1)``), then
    ``-log(-log(u))``; it does not depend on the other rows.

    Args:
        seeds: B sampling seeds (ints); positions: B absolute positions (0-based, prompt included)
            of the tokens being drawn; vocab: vocabulary size V.
    Returns:
        ``[B, V] float32``.
    """
    u = torch.empty(len(seeds), vocab, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    for row, (seed, position) in enumerate(zip(seeds, positions)):  # B small C calls, no per-token work
        gen.manual_seed(noise_key(seed, position))
        u[row].uniform_(generator=gen)
    return u.clamp_(min=2.0**-25).log_().neg_().log_().neg_()


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


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: list[int],
    positions: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its log-prob under ``log_softmax(logits / T)``.

    Args:
        logits: ``[B, V] float32`` next-token logits.
        temperature: ``[B] float32``; 0 ⇒ greedy.
        top_p: ``[B] float32`` in (0, 1]; top_k: ``[B] int64``, -1 ⇒ whole vocabulary.
        seeds, positions: B ints each — see ``gumbel_noise``.
    Returns:
        tokens ``[B] int64`` and logprobs ``[B] float32``.
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32, f"logits must be [B, V] float32, got {logits.shape} {logits.dtype}"
    greedy = temperature <= 0
    z = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(z, dim=-1)
    rows = [b for b, g in enumerate(greedy.tolist()) if not g]
    if len(rows) < len(logits):  # some rows are greedy
        tokens = torch.argmax(logits, dim=-1)
    else:
        tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        zs = logprobs[index]  # log_softmax(z) = z - const: same argmax, finite where z is
        needs_filter = (top_k[index] > 0) | (top_p[index] < 1.0)
        if bool(needs_filter.any()):
            sub = needs_filter.nonzero().flatten()
            zs[sub] = _filter_top_k_top_p(zs[sub], top_k[index][sub], top_p[index][sub])
        zs += gumbel_noise([seeds[b] for b in rows], [positions[b] for b in rows], logits.shape[-1], logits.device)
        tokens[index] = torch.argmax(zs, dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
