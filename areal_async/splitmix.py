"""splitmix64 (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators") on
Python ints: the one definition of its constants and its output function.

``mix64`` is splitmix64's output function (Stafford's "Mix13" variant of MurmurHash3's 64-bit
finalizer); ``splitmix64(x)`` is the first output of the stream seeded ``x``,
``mix64(x + GOLDEN)``. The sampling seeds of a run (``types.sample_seed``) and the noise keys of
the inference sampler (``embedded/engine/noise_hash.py``) are built from them. All values are unsigned
64-bit ints (arithmetic modulo 2**64).
"""

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
