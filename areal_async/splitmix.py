"""splitmix64 (Steele, Lea and Flood 2014) on Python ints, unsigned 64-bit: ``mix64`` (its output
function, Stafford's Mix13) and ``splitmix64(x) = mix64(x + GOLDEN)``; the one definition that
``types.sample_seed`` and the engine's sampling noise (``embedded/engine/noise_hash.py``) build on."""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: splitmix64's Weyl-sequence increment
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # mix64's multipliers


def mix64(x: int) -> int:
    """splitmix64's output function of ``x`` (taken modulo 2**64), an unsigned 64-bit int."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def splitmix64(x: int) -> int:
    """The first output of the splitmix64 stream seeded with ``x``, an unsigned 64-bit int."""
    return mix64(x + GOLDEN)
