"""The staleness bound: how many more groups the queue may admit, and which version a group needs.

Pure integer functions of docs/design.md#staleness-the-one-definition. The bound is AReaL's (Fu et
al., 2025, arXiv:2505.24298, §5.1): at version ``v`` at most ``(η + v + 1) * B`` groups may ever
have been admitted, so no sample trained at step ``i ≥ v`` is older than ``i - η``.
"""

from __future__ import annotations


def admission_capacity(
    version: int,
    accepted: int,
    running: int,
    batch_size: int,
    max_staleness: int,
    max_concurrent: int,
) -> int:
    """Number of groups the queue may admit now; always ``>= 0``.

    ``capacity = min(max_concurrent - running, (η + v + 1) * B - (accepted + running))``,
    clamped at 0.

    Args:
        version: ``v``, latest live policy version, ``>= 0``.
        accepted: groups that ever finished into the buffer, ``>= 0``. After a resume from
            version ``v`` it restarts at ``v * B``.
        running: groups leased and not finished, ``>= 0``.
        batch_size: ``B``, groups per training batch, ``>= 1``.
        max_staleness: ``η``, ``>= 0`` (0 = synchronous RL).
        max_concurrent: upper bound on running groups, ``>= 1``.

    Raises:
        ValueError: a negative count, ``batch_size < 1`` or ``max_concurrent < 1``.
    """
    if min(version, accepted, running, max_staleness) < 0:
        raise ValueError(
            f"admission_capacity needs non-negative counts, got version={version}, "
            f"accepted={accepted}, running={running}, max_staleness={max_staleness}"
        )
    if batch_size < 1 or max_concurrent < 1:
        raise ValueError(
            f"batch_size ({batch_size}) and max_concurrent ({max_concurrent}) must be >= 1"
        )
    by_concurrency = max_concurrent - running
    by_staleness = (max_staleness + version + 1) * batch_size - (accepted + running)
    return max(0, min(by_concurrency, by_staleness))


def group_version(group_id: int, batch_size: int, max_staleness: int) -> int:
    """``v(g) = max(0, floor(g / B) - η)``: the policy version that generates group ``g``.

    Used by deterministic mode (docs/design.md, "Determinism"): group ``g`` is admitted only once
    version ``v(g)`` is live, and version ``j + 1`` goes live only after every group with
    ``v(g) <= j`` has finished. Group ``g`` lands in training batch ``floor(g / B)``, so its
    staleness at training time is ``min(floor(g / B), η)``.

    Raises:
        ValueError: ``group_id < 0``, ``batch_size < 1`` or ``max_staleness < 0``.
    """
    if group_id < 0 or batch_size < 1 or max_staleness < 0:
        raise ValueError(
            f"group_version needs group_id >= 0, batch_size >= 1, max_staleness >= 0; got "
            f"{group_id}, {batch_size}, {max_staleness}"
        )
    return max(0, group_id // batch_size - max_staleness)


def group_id_limit(version: int, batch_size: int, max_staleness: int) -> int:
    """First group id that needs a version newer than ``version``: ``(version + η + 1) * B``.

    Inverse of ``group_version``: ``v(g) <= version  ⇔  g < (version + η + 1) * B`` for
    ``version >= 0``.
    """
    return (version + max_staleness + 1) * batch_size
