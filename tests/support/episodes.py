"""Episodes built by hand: ``episode`` (a sample from sampled turns and unsampled parts),
``segment`` (a further training sequence from the same parts), ``through_the_queue``, and the groups of
``tests/test_turns.py`` (``group0``: EP0 and EP1; ``restarted_group``), described there.
"""

from __future__ import annotations

import numpy as np

from areal_async.types import Array, Sample, Segment, Trajectory


def token_fields(parts: list, tool_logprob=0.0, tool_version=-1) -> dict:
    """Per-token fields of ``parts``: ``(ids, logprobs, version)`` for a sampled turn, ``(ids,)``
    for tokens the model did not sample (log-prob ``tool_logprob``, version ``tool_version``: 0
    and −1 as the types say, or garbage to show nothing reads them): ``output_ids``,
    ``behav_logprobs``, ``versions``, ``loss_mask`` and ``turn_spans`` (one span per sampled part)."""
    ids, mask, logp, versions, spans = [], [], [], [], []
    for part in parts:
        n = len(part[0])
        if len(part) == 3:
            spans.append((len(ids), len(ids) + n))
        ids += part[0]
        mask += [len(part) == 3] * n
        logp += list(part[1]) if len(part) == 3 else [tool_logprob] * n
        versions += [part[2]] * n if len(part) == 3 else [tool_version] * n
    return dict(output_ids=Array.of(ids, "int32"), behav_logprobs=Array.of(logp, "float32"),
                versions=Array.of(versions, "int32"), loss_mask=Array.of(mask, "uint8"),
                turn_spans=Array.of(np.reshape(spans, (-1, 2)), "int32"))


def segment(prompt: list[int], parts: list, turns: bool = True) -> Segment:
    """A segment with its own ``prompt`` and the tokens of ``parts`` (``token_fields``); without
    ``turns`` its ``turn_spans`` is ``None``."""
    fields = token_fields(parts)
    if not turns:
        fields["turn_spans"] = None
    return Segment(prompt_ids=Array.of(prompt, "int32"), **fields)


P = [11, 12, 13, 14]
TOOL = [31, 32, 33]


def episode(index: int, parts: list, reward: float, turn_rewards=None, seed: int = 0, tool_logprob=0.0,
            tool_version=-1) -> Sample:
    """A sample from ``parts`` (``token_fields``), with ``turn_spans`` and ``turn_rewards`` where
    ``turn_rewards`` is given."""
    fields = token_fields(parts, tool_logprob, tool_version)
    if turn_rewards is None:
        fields["turn_spans"] = None
    else:
        fields["turn_rewards"] = Array.of(turn_rewards, "float32")
    return Sample(index=index, seed=seed, finish_reason="stop", reward=reward, **fields)


def ep0(**kw) -> Sample:
    return episode(0, [([21, 22], [-1.0, -2.0], 3), (TOOL,), ([23, 24], [-3.0, -4.0], 2)], 5.0, [3.0, 3.0], **kw)


def ep1() -> Sample:
    return episode(1, [([21, 22], [-1.5, -2.5], 3), (TOOL,), ([26, 27, 28], [-0.5, -0.25, -0.125], 3)], -5.0,
                   [1.0, 1.0])


def group0(**kw) -> Trajectory:
    return Trajectory(group_id=0, prompt_ids=Array.of(P, "int32"), samples=[ep0(**kw), ep1()], data_index=0)


def restarted_group() -> Trajectory:
    """Group 1: a single-response sample, and an episode restarted as a new sample whose earlier
    turn is context (loss mask 0 on tokens another sample of the batch sampled)."""
    single = Sample(index=0, seed=0, output_ids=Array.of([21, 22, 41], "int32"),
                    behav_logprobs=Array.of([-1.0, -1.0, -2.0], "float32"), versions=Array.of([3, 3, 3], "int32"),
                    finish_reason="stop", reward=5.0)
    restarted = episode(1, [([21, 22],), (TOOL,), ([25], [-0.75], 3)], -5.0)
    return Trajectory(group_id=1, prompt_ids=Array.of(P, "int32"), samples=[single, restarted], data_index=1)




def through_the_queue(traj: Trajectory) -> list[Trajectory]:
    """``traj`` as a worker sends it (a msgpack ``Submit`` frame) through an in-process queue
    (η = 0, batch size 1), and the batch the trainer takes back."""
    import asyncio

    import msgspec

    from areal_async.config import QueueConfig
    from areal_async.queue.core import ReplayQueue
    from areal_async.queue.protocol import Submit

    frame = msgspec.msgpack.encode(Submit(rid=1, traj=traj))

    async def body():
        q = ReplayQueue(QueueConfig(batch_size=1, max_staleness=0, max_concurrent=1), "throughput")
        assert await q.lease(0, 1) == [0]
        await q.submit(msgspec.msgpack.decode(frame, type=Submit).traj)
        return await q.get_batch(0)

    return asyncio.run(body())
