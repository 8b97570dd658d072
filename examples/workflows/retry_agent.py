"""An OpenAI-client workflow: answer, and on a wrong answer try again after feedback.

Named in the config as ``rollout.workflow: examples.workflows.retry_agent:run``
(docs/workflows.md). ``client`` is a stock ``openai.AsyncOpenAI``: any agent code that calls
``chat.completions.create`` runs unchanged. Each call is one model turn; the episode's reward is
per turn: 1 on the turn that answers right, 0 on the others.
"""

from __future__ import annotations

from areal_async.reward.math import math_reward

ATTEMPTS = 3


async def run(item, client) -> dict[int, float]:
    messages = list(item.messages)  # the group's prompt: its tokens are shared by the group
    for turn in range(ATTEMPTS):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        if math_reward(text, item.answer) > 0.5:
            return {turn: 1.0}
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "That is not right. Check your work and answer again in \\boxed{}."}]
    return {}
