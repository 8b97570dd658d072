"""``Env`` classes for end-to-end episode tests, named as ``rollout.workflow``.

``ThreeTurnToolEnv``: exactly 3 model turns, each answered by a real tool run through ``ToolSet``
whose input and seed are functions of the turn's tokens and seed only: after turn 0 the calculator
(``len(ids) * (seed % 997) / 7``), after turn 1 the python tool (a program drawing from
``random``, seeded by the tool with the turn's seed); the tool's ``message()`` is the observation.
The episode ends after turn 2. Each turn's reward is the parity of its last token id (0 for an
empty turn), so rewards are mixed; info counts the tool calls and errors.
"""

from __future__ import annotations

from areal_async.tools import ToolCall, ToolSet

TOOLS = ToolSet(["calculator", "python"], timeout_s=20.0)


class ThreeTurnToolEnv:
    """One episode of three turns; the first observation is the group's prompt."""

    def reset(self, item, seed):
        return None

    async def step(self, action):
        reward = float(action.ids[-1] % 2) if action.ids else 0.0
        if action.turn >= 2:
            return None, reward, True, {}
        if action.turn == 0:
            call = ToolCall("calculator", f"{len(action.ids)}*{action.seed % 997}/7")
        else:
            call = ToolCall("python", f"import random\nprint(random.randint(0, 10**6), {len(action.ids)})")
        result = await TOOLS.run(call, seed=action.seed)
        return [result.message()], reward, False, {"tool_calls": 1, "tool_errors": int(result.error is not None)}
