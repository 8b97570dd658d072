"""An ``Env`` workflow (token-level shape): arithmetic with a calculator tool.

Named in the config as ``rollout.workflow: examples.workflows.calculator_env:CalculatorEnv``
(docs/workflows.md). Each model turn either calls the calculator, ``<calculator>12*7</calculator>``
(generation stops at the end tag; the result comes back as a tool message), or answers in
``\\boxed{}``, which ends the episode: reward 1 for the right number, 0 otherwise. A turn that
does neither ends it too, with reward 0.
"""

from __future__ import annotations

from areal_async.reward.math import math_reward
from areal_async.tools import ToolSet

TOOLS = ToolSet(["calculator"], timeout_s=5.0)


class CalculatorEnv:
    """One episode: ``reset`` keeps the item, ``step`` runs a call or scores an answer."""

    stop = TOOLS.stop_strings  # every model turn stops at a call's end tag

    def reset(self, item, seed):
        self.answer = item.answer
        rules = TOOLS.system_prompt()
        if item.messages and item.messages[0]["role"] == "system" and rules in item.messages[0]["content"]:
            return None  # the prompt states the tool's rules already (data.task=calc): the group's prompt
        system = {"role": "system", "content": rules}
        return [system, *item.messages]  # the first observation: the prompt, with the tool's rules

    async def step(self, action):
        call = TOOLS.parse(action.text) if action.finish_reason == "stop" else None
        if call is None:  # an answer (or nothing usable): the episode ends here
            correct = math_reward(action.text, self.answer) > 0.5
            return None, float(correct), True, {"correct": correct}
        result = await TOOLS.run(call, seed=action.seed)
        info = {"tool_calls": 1, "tool_errors": int(result.error is not None)}
        return [result.message()], 0.0, False, info
