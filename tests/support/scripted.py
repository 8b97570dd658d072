"""A generation client that answers from a script: turn t of every episode gets ``replies[t]``,
encoded with the tokenizer (the engine's ids; an end-of-turn token appended when the reply does
not end on one of the request's stop strings), log-probs -0.5 and version ``version``; cut to the
request's ``max_new_tokens`` (then finish reason ``length``); each after ``delay_s`` seconds (a
slow or paused engine)."""

from __future__ import annotations

import asyncio

from areal_async.inference.client import GenResult


class ScriptedClient:
    urls = ["scripted://0"]

    def __init__(self, tokenizer, replies: list[str], version: int = 0, delay_s: float = 0.0):
        self.tokenizer, self.replies, self.version, self.delay_s = tokenizer, replies, version, delay_s
        self.calls: list[tuple[str, list[int], dict]] = []

    async def generate(self, input_ids, sampling, rid, server=None, session=None) -> GenResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        t = int(rid.rsplit("-t", 1)[1]) if "-t" in rid else 0
        text = self.replies[t]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        stopped = any(text.endswith(s) for s in sampling.get("stop", []))
        if not stopped:
            ids.append(self.tokenizer.eos_token_id)
        finish = "length" if len(ids) > sampling["max_new_tokens"] else "stop"
        ids = ids[:sampling["max_new_tokens"]]
        self.calls.append((rid, list(input_ids), dict(sampling)))
        return GenResult(ids, [-0.5] * len(ids), [self.version] * len(ids), finish, prompt_tokens=len(input_ids))


QUESTION = [{"role": "user", "content": "What is 12 times 7?"}]


def scripted_episode(tok, replies=("a", "b", "c"), max_turns: int = 4, delay_s: float = 0.0, **limits):
    """Episode g0-s2 (seed 9) of ``QUESTION`` whose turns a ``ScriptedClient`` answers with ``replies``,
    each after ``delay_s`` seconds; ``limits``: ``Episode``'s ``max_episode_tokens``, ``max_seq_len``."""
    from areal_async.rollout.episode import Episode

    prompt = tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    return Episode(ScriptedClient(tok, list(replies), delay_s=delay_s), tok, tok.decode, 0, 2, 9, prompt, QUESTION,
                   {"stop_token_ids": [tok.eos_token_id]}, server=0, max_new_tokens=16, max_turns=max_turns,
                   **limits)


def run_workflow(workflow, ep, bound_s: float = 5.0):
    """``workflow``'s checked sample of ``ep`` (item ``QUESTION``, answer 84) within ``bound_s``."""
    import asyncio

    from areal_async.rollout.workflows import EpisodeItem

    sample = asyncio.run(asyncio.wait_for(workflow(ep, EpisodeItem(QUESTION, "84")), bound_s))
    sample.check()
    return sample


def run_in_loop(workflow, ep, bound_s: float = 5.0):
    """``run_workflow``'s sample, or its exception, with the loop's tasks left at its end."""
    import asyncio

    from areal_async.rollout.workflows import EpisodeItem

    async def main():
        try:
            return await asyncio.wait_for(workflow(ep, EpisodeItem(QUESTION, "84")), bound_s), []
        except Exception as exc:
            await asyncio.sleep(0.05)  # the tasks cancelled by it end
            return exc, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    return asyncio.run(main())
