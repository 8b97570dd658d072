"""Messages that cross process boundaries: a ``Trajectory`` (one scored group, with the version of
every output token) and ``Array`` (raw bytes with dtype and shape, never Python lists)."""

from __future__ import annotations

import numpy as np
import msgspec

from .splitmix import GOLDEN, MIX1, MIX2, mix64


class Array(msgspec.Struct, frozen=True, array_like=True):
    """A dense array as raw little-endian bytes. ``dtype`` is a numpy dtype name."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, values, dtype: str) -> "Array":
        arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
        return cls(dtype=arr.dtype.name, shape=tuple(arr.shape), data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def tolist(self) -> list:
        return self.numpy().tolist()


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One response of a group.

    Fields:
        index: sample index i within the group, ``0 <= i < n_samples``.
        seed: the sampling seed used for this response (``sample_seed(run_seed, g, i)``).
        output_ids: ``[L] int32`` generated token ids (L may be 0).
        behav_logprobs: ``[L] float32`` log-probs of the sampled tokens under the behaviour
            policy's temperature-scaled distribution, as returned by the server.
        versions: ``[L] int32`` policy version that produced each output token.
        finish_reason: ``stop`` | ``length`` | ``abort``.
        reward: scaled scalar reward (e.g. +5 / -5).
        correct: whether the verifier accepted the answer.
        reward_error: the verifier raised or timed out (scored as wrong).
    """

    index: int
    seed: int
    output_ids: Array
    behav_logprobs: Array
    versions: Array
    finish_reason: str
    reward: float = 0.0
    correct: bool = False
    reward_error: bool = False


class Trajectory(msgspec.Struct, frozen=True, kw_only=True):
    """One finished group: a prompt and its ``n_samples`` scored responses.

    Fields:
        group_id: sequence id g of the group (global, 0, 1, 2, ...).
        prompt_ids: ``[P] int32`` prompt token ids (chat template applied).
        samples: ``n_samples`` responses, ordered by ``Sample.index``.
        data_index: index of the prompt in the training set.
        worker: id of the generation worker that produced it (diagnostics only).
        gen_s: wall-clock seconds from lease to finish (diagnostics only).
    """

    group_id: int
    prompt_ids: Array
    samples: list[Sample]
    data_index: int
    worker: int = 0
    gen_s: float = 0.0

    def min_version(self) -> int:
        """Oldest policy version that produced any token of this group (``0`` if empty)."""
        mins = [int(s.versions.numpy().min()) for s in self.samples if s.versions.shape[0]]
        return min(mins) if mins else 0


def sample_seed(run_seed: int, group_id: int, index: int) -> int:
    """Sampling seed of sample (g, i): a hash of (run seed, g, i), in ``[0, 2**63)``.

    Distinct within a group and independent of which worker or server runs the request
    (docs/design.md, "Determinism"). Uses splitmix64's output function (``splitmix.mix64``) over
    a weighted sum of the three integers.
    """
    return mix64(run_seed * GOLDEN + group_id * MIX1 + index * MIX2) >> 1
