"""A sequence's tokens after its last sampled token (an observation no turn followed) are left out
of the sample; a sequence with no sampled token is kept whole. Against a scripted client
(``tests/support/scripted.py``)."""

from __future__ import annotations

from areal_async.rollout.workflows import EnvWorkflow
from tests.support.scripted import run_workflow, scripted_episode


class NeverDone:
    """A user message after every turn, never done."""

    def reset(self, item, seed):
        return None

    def step(self, action):
        return [{"role": "user", "content": "and then?"}], 1.0, False


class DoneAtOnce(NeverDone):
    def step(self, action):
        return None, 1.0, True


def test_an_observation_no_turn_followed_is_left_out_of_the_sample(tok):
    # the truncated episode packed the user message and the template tokens after its last turn
    cut = run_workflow(EnvWorkflow(NeverDone), scripted_episode(tok, max_turns=1))
    ended = run_workflow(EnvWorkflow(DoneAtOnce), scripted_episode(tok, max_turns=1))
    assert cut.stats.truncated and not ended.stats.truncated
    fields = ("output_ids", "behav_logprobs", "versions", "loss_mask", "turn_spans", "turn_rewards")
    assert all(getattr(cut, f) == getattr(ended, f) for f in fields)
    ep = scripted_episode(tok)  # a sequence with no sampled token stays whole
    ep.start().add_ids([5, 6])
    assert ep.to_sample(0.0, False).output_ids.tolist() == [5, 6]
