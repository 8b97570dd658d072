"""An agent's model calls (``OpenAIWorkflow`` and its recording endpoint) against a scripted client
(``tests/support/scripted.py``): what fails in the engine is the engine's failure, not the agent's,
and a call the endpoint cannot answer is refused naming the field."""

from __future__ import annotations

import openai
import pytest

from areal_async.inference.client import ServerError
from areal_async.rollout.workflows import OpenAIWorkflow
from tests.support.scripted import ScriptedClient, run_workflow, scripted_episode


class DeadServer(ScriptedClient):
    async def generate(self, input_ids, sampling, rid, server=None, session=None):
        raise ServerError("scripted://0", 502, "server gone")


def dead_server_episode(tok):
    ep = scripted_episode(tok)
    ep.client = DeadServer(tok, [])
    return ep


async def one_call(item, client):
    await client.chat.completions.create(model="p", messages=item.messages)
    return 1.0


async def catches_everything(item, client):
    try:
        await client.chat.completions.create(model="p", messages=item.messages)
    except Exception:
        return 0.5
    return 1.0


@pytest.mark.parametrize("on_env_error", ["raise", "zero"])
@pytest.mark.parametrize("run", [one_call, catches_everything])
def test_an_engine_failure_in_an_agents_call_fails_the_worker_as_it_does_in_any_workflow(tok, on_env_error, run):
    # it was run's failure: zeroed under on_env_error=zero (the group trained on nothing, never replayed),
    # or a sample with the agent's reward for a turn that never came
    with pytest.raises(ServerError, match="server gone"):
        run_workflow(OpenAIWorkflow(run, 1.0, 1.0, on_env_error=on_env_error), dead_server_episode(tok))
