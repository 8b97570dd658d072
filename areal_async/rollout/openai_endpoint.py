"""The recording endpoint behind an episode's ``openai.AsyncOpenAI``: ``POST /v1/chat/completions``
answered in process (an ``httpx`` transport, no port), token in / token out.

A call whose ``messages`` are the recorded conversation plus new ones (the texts it was given back
unchanged) continues it: the new messages are rendered after the recorded ids
(``Conversation.add_messages``) and the turn is sampled after them. Any other call (an edited
history, reasoning stripped from an earlier turn) starts a new training sequence of the episode
(``Episode.start``): never a corrupted one. Calls of one episode are made one at a time.
``model_clock`` times them (``env_limit.ModelClock``): the time with a call in flight does not
count against ``rollout.env_timeout_s``.
Sampling follows the run (``rollout.temperature``, ``top_p``; an evaluation's calls, greedy, may
state the run's values too); a call that asks otherwise, or for ``n > 1``, a penalty, a logit
bias, a response format, streaming or ``tools``, or whose messages are no chat messages, whose
``stop`` is no string or list of non-empty strings, or whose ``max_tokens``/``max_completion_tokens``
is no whole number >= 1, is answered 400 naming the field. ``logprobs=true`` returns each sampled
token of the turn with its behaviour log-prob (the numbers the trainer's record holds, the
end-of-turn token and a stop string's tokens included) in OpenAI's chat shape
(``token_logprobs.LogprobRenderer.chat``); ``top_logprobs`` above 0 is refused (the engine returns
the sampled token's log-prob only). A generation that fails (a server gone,
its retries used up) is kept in ``failure``: the workflow raises it once ``run`` ends, whatever
``run`` made of it.
"""

from __future__ import annotations

import contextlib
import json

import httpx

from areal_async.rollout.env_limit import ModelClock
from areal_async.rollout.episode import Episode, EpisodeTruncated
from areal_async.token_logprobs import LogprobRenderer

BASE_URL = "http://episode.invalid/v1"


class RecordingEndpoint:
    """Answers an episode's chat-completion calls through ``episode.generate``.

    Args:
        episode: the episode every call belongs to.
        temperature, top_p: the episode's sampling parameters (a call may repeat them, not change them).
        stated: the run's ``(temperature, top_p)``, which a call may state too where the episode samples
            otherwise (a greedy evaluation); default the episode's.
    """

    def __init__(self, episode: Episode, temperature: float, top_p: float,
                 stated: tuple[float, float] | None = None):
        self.episode, self.temperature, self.top_p = episode, temperature, top_p
        self.stated = stated or (temperature, top_p)
        self.refusals = 0  # calls answered 400 for a limit: max_turns, max_episode_tokens, the context
        self.failure: Exception | None = None  # the first generation that failed, raised by the workflow
        self.model_clock = ModelClock()  # the seconds with a call in flight, which run's limit does not count
        self._render: LogprobRenderer | None = None

    @contextlib.asynccontextmanager
    async def client(self):
        """An ``openai.AsyncOpenAI`` (no retries) whose requests this endpoint answers."""
        import openai

        http = httpx.AsyncClient(transport=httpx.MockTransport(self._handle), base_url=BASE_URL)
        async with openai.AsyncOpenAI(base_url=BASE_URL, api_key="episode", http_client=http,
                                      max_retries=0) as client:
            yield client

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return _error(404, f"{request.method} {request.url.path}: an episode's client answers only "
                               f"POST /v1/chat/completions")
        if self.model_clock.in_flight:
            return _error(400, "a call of this episode is in flight: make an episode's calls one at a time "
                               "(await each), so that its turns have one order")
        with self.model_clock.call():
            return await self._complete(json.loads(request.content or b"{}"))

    async def _complete(self, body: dict) -> httpx.Response:
        problem = self._refused(body)
        if problem:
            return _error(400, problem)
        ep, messages = self.episode, body["messages"]
        if len(ep.turns) >= ep.max_turns:  # refused before anything is recorded
            ep.stats["truncated"] = True
            self.refusals += 1
            return _error(400, f"episode {ep.name} made its max_turns={ep.max_turns} calls (rollout.max_turns)")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        new = ep.conversation.extension(messages) if ep.conversations else None
        if new is None:
            ep.start(messages)
        else:
            ep.conversation.add_messages(new)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        try:
            turn = await ep.generate(stop=stop, max_new_tokens=limit, record_text=lambda text: _trim(text, stop))
        except EpisodeTruncated as exc:
            self.refusals += 1
            return _error(400, str(exc))
        except Exception as exc:  # the engine's failure, not the agent's: kept for the workflow to raise
            self.failure = self.failure or exc
            raise
        content = _trim(turn.text, stop)
        logprobs = None
        if body.get("logprobs"):
            self._render = self._render or LogprobRenderer(ep.tokenizer)
            logprobs = self._render.chat(turn.ids, turn.logprobs)
        return httpx.Response(200, json={
            "id": f"chatcmpl-{ep.name}-t{turn.index}", "object": "chat.completion",
            "created": 0, "model": body.get("model") or "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": turn.finish_reason, "logprobs": logprobs}],
            "usage": {"prompt_tokens": len(ep.conversation.ids) - len(turn.ids),
                      "completion_tokens": len(turn.ids),
                      "total_tokens": len(ep.conversation.ids)},
        })

    def _refused(self, body: dict) -> str | None:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return "messages must be a non-empty list of chat messages"
        for k, m in enumerate(body["messages"]):
            if not isinstance(m, dict):
                return (f"messages[{k}] is {type(m).__name__} {m!r:.60}, not a chat message (an object with "
                        f"'role' and 'content')")
            if not isinstance(m.get("role"), str):
                return f"messages[{k}] has no 'role' (a string: system, user, assistant, tool)"
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) and stop) and not (
                isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
            return f"stop={stop!r:.80}: give a stop string or a list of them (none empty), or leave stop out"
        for name in ("max_tokens", "max_completion_tokens"):
            got = body.get(name)
            if got is not None and (not isinstance(got, int) or isinstance(got, bool) or got < 1):
                return (f"{name}={got!r}: give a whole number >= 1, or leave it out for the run's "
                        f"rollout.max_new_tokens")
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            return f"logprobs={logprobs!r:.60}: give true or false (true: each sampled token's log-prob)"
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
            return f"top_logprobs={top!r:.60}: give a whole number >= 0, or leave top_logprobs out"
        if top:
            return (f"top_logprobs={top}: the engine returns the sampled token's log-prob only, not the {top} most "
                    f"likely tokens at each position; send 0 or leave top_logprobs out (each token's entry then "
                    f"has top_logprobs [])")
        checks = [("n", 1, body.get("n"), 1),
                  ("temperature", self.temperature, body.get("temperature"), self.stated[0]),
                  ("top_p", self.top_p, body.get("top_p"), self.stated[1])]
        for name, want, got, stated in checks:
            if got is not None and float(got) not in (float(want), float(stated)):
                return (f"{name}={got}: an episode samples with the run's {name} ({want}), which the "
                        f"trainer's log-probs assume; leave {name} out or set rollout.{name}")
        for name, default in (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", {}),
                              ("response_format", {"type": "text"})):
            got = body.get(name)
            if got is not None and got != default:
                return (f"{name}={got!r:.80}: an episode samples as the run does (its log-probs are the "
                        f"trainer's behaviour policy), so nothing may reshape the distribution; leave "
                        f"{name} out")
        if body.get("stream"):
            return "stream=true: an episode's calls are answered whole; leave stream out"
        if body.get("tools"):
            return ("tools=: describe the tools in the system prompt and parse the calls in the workflow "
                    "(docs/workflows.md)")
        return None


def _trim(text: str, stop: list[str]) -> str:
    """The text before the first stop string in it (OpenAI's ``content`` leaves the stop out)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "code": status}})
