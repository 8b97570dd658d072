"""The sampler's counter-based Gumbel noise: a pure function of (seed, position, vocab index).

Row key ``noise_key(seed, p) = splitmix64(splitmix64(seed) ^ p)``; entry i folds it to 32 bits
``k`` and hashes ``k + i * WEYL32`` with MurmurHash3's ``fmix32`` (Appleby 2011), whose top 23 bits
give ``u = (bits + 0.5) / 2**23`` and the noise ``-log(-log(u))``. The pure-Python reference
(``noise_uniform``), torch's 32-bit lanes (``gumbel_from_keys``) and ``triton_sampling.py`` draw
the same uniforms.
"""

from __future__ import annotations

import functools

import torch

from ...splitmix import GOLDEN, MASK64, MIX1, MIX2, splitmix64

WEYL32 = 0x9E3779B9  # 2**32 / golden ratio: the counter's step
FMIX1, FMIX2 = 0x85EBCA6B, 0xC2B2AE35  # fmix32's multipliers
_MASK32 = (1 << 32) - 1


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise row drawn for ``position`` of a request seeded ``seed``."""
    return splitmix64(splitmix64(seed & MASK64) ^ (position & MASK64))


def _fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer (Appleby 2011) of an unsigned 32-bit int."""
    x = ((x ^ (x >> 16)) * FMIX1) & _MASK32
    x = ((x ^ (x >> 13)) * FMIX2) & _MASK32
    return x ^ (x >> 16)


def noise_uniform(key: int, index: int) -> float:
    """Reference (pure Python) of the uniform at vocab ``index`` of the row keyed ``key``, in
    ``(0, 1)`` and exact in float32 (the module docstring gives the formula)."""
    k = (key >> 32) ^ (key & _MASK32)
    return ((_fmix32((k + index * WEYL32) & _MASK32) >> 9) + 0.5) / 2.0**23


def _signed(x: int, bits: int = 64) -> int:
    """An unsigned int of ``bits`` bits as the signed int with the same bits."""
    return x - (1 << bits) if x >= 1 << (bits - 1) else x


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of an int64 / int32 tensor (torch's ``>>`` is arithmetic)."""
    bits = 64 if x.dtype == torch.int64 else 32
    return (x >> shift) & ((1 << (bits - shift)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function (``splitmix.mix64``) on int64 tensors (multiplication wraps
    modulo 2**64)."""
    x = (x ^ _lsr(x, 30)) * _signed(MIX1)
    x = (x ^ _lsr(x, 27)) * _signed(MIX2)
    return x ^ _lsr(x, 31)


@functools.lru_cache(maxsize=1 << 14)
def _seed_key(seed: int) -> int:
    """``splitmix64(seed)`` as a signed int64 (cached: a request's seed is hashed every step)."""
    return _signed(splitmix64(seed & MASK64))


def noise_keys(seeds: list[int], positions: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``noise_key`` of each (seed, position) pair as ``[B] int64`` (the bits of the unsigned key)."""
    seed_keys = torch.tensor([_seed_key(s) for s in seeds], dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    return _mix64((seed_keys ^ pos) + _signed(GOLDEN)).to(device)


def gumbel_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, V] float32`` for ``keys: [B] int64`` (``noise_keys``): entry (b, i)
    is ``-log(-log(u))`` with ``u = noise_uniform(keys[b], i)``; a pure function of (key, i)."""
    folded = (_lsr(keys, 32) ^ (keys & _MASK32)).to(torch.int32)  # wraps to the same 32 bits
    counter = torch.arange(vocab, dtype=torch.int32, device=keys.device) * _signed(WEYL32, 32)
    x = folded[:, None] + counter[None, :]
    x ^= _lsr(x, 16)
    x *= _signed(FMIX1, 32)
    x ^= _lsr(x, 13)
    x *= _signed(FMIX2, 32)
    x ^= _lsr(x, 16)
    return _lsr(x, 9).to(torch.float32).add_(0.5).mul_(2.0**-23).log_().neg_().log_().neg_()


def gumbel_noise(seeds: list[int], positions: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise that is a pure function of (seed, position, vocab index).

    Row b is keyed by ``noise_key(seeds[b], positions[b])``; entry i is ``-log(-log(u))`` with
    ``u = noise_uniform(key, i)``, a hash of (key, i) (a counter-based generator: any entry is
    computed directly, so all rows come from a few vectorised kernels and none depends on the
    other rows).

    Args:
        seeds: B sampling seeds (ints); positions: B absolute positions (0-based, prompt included)
            of the tokens being drawn; vocab: vocabulary size V.
    Returns:
        ``[B, V] float32``.
    """
    return gumbel_from_keys(noise_keys(seeds, positions, device), vocab)
