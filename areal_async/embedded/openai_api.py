"""The OpenAI-compatible endpoints of the embedded server, as SGLang serves them over its engine.

``/v1/models`` (and ``/v1/models/{id}``), ``/v1/completions`` and ``/v1/chat/completions``, plain
and streamed (``streaming.py``). A request is mapped onto the ``sampling_params`` of the same
``/generate`` (``_SAMPLING``; ``request.decode_sampling``), so it means and refuses what that would.
Choice ``i`` of a prompt (index ``prompt * n + i``) is seeded ``seed`` for ``i = 0``, then
``types.sample_seed(seed, 0, i)``. Fields the engine cannot honour pass only at their neutral
value (``_NEUTRAL``), else HTTP 400 naming the field; a full queue is HTTP 503 (``admission.py``).
Choices carry the engine's per-token log-probs and token ids when asked (``logprobs``, with no top
alternatives: ``top_logprobs`` / completions' ``logprobs`` above 0 are a 400; SGLang's
``return_token_ids`` and ``sglext`` ids), shaped by ``openai_choices.py``.
SGLang's shapes, and where this server differs: docs/sglang_api.md#openai-compatible-entrypointsopenai.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from ..types import sample_seed
from . import fields
from .engine.admission import QueueFull, retry_after_headers
from .engine.engine import Engine
from .engine.requests import Completion, EngineFailed
from .request import decode_sampling
from .engine.stop import answer_text
from .engine.sampling import SamplingParams
from .openai_choices import ChatFormat, CompletionFormat, Format, LogprobRenderer, Returns
from .streaming import SSE_DONE, NonFiniteLogprobs, run_requests, running_text, sse_event, start_sse

# OpenAI field → SGLang sampling_params key, for the sampling fields both endpoints map alike
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "seed": "sampling_seed", "stop": "stop",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    # SGLang's extensions of the OpenAI requests
    "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_new_tokens", "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids", "stop_regex": "stop_regex", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim", "regex": "regex",
    "ebnf": "ebnf", "json_schema": "json_schema",
}
# fields accepted only at one of these values: the neutral ones clients send by default
_NEUTRAL = {
    "logit_bias": (None, {}),
    "user": None,  # any value: an end-user id, only for the provider's records
    "stream_options.continuous_usage_stats": (None, False),
    "response_format": (None, {"type": "text"}),
}
_COMPLETION_NEUTRAL = {**_NEUTRAL, "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}
_CHAT_NEUTRAL = {**_NEUTRAL, "tools": (None, []),
                 "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
                 "continue_final_message": (None, False), "separate_reasoning": (None, True)}


class OpenAIError(ValueError):
    """A request refused with OpenAI's error body; ``param`` is the offending field, if one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        headers = retry_after_headers() if self.status == 503 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


class OpenAIApi:
    """Handlers of the ``/v1`` endpoints over ``engine``; ``model`` is the id ``/v1/models`` lists."""

    def __init__(self, engine: Engine, tokenizer, model: str, stream_interval: int = 1):
        self.engine, self.tokenizer, self.model_id, self.stream_interval = engine, tokenizer, model, stream_interval
        self.logprobs = LogprobRenderer(tokenizer)

    # ---- models ---------------------------------------------------------------------------------

    def _card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": self.model_id, "parent": None, "max_model_len": self.engine.max_seq_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_id:
            return web.json_response({"error": {"message": f"The model '{name}' does not exist", "type":
                                                "invalid_request_error", "param": "model", "code": "model_not_found"}},
                                     status=404)
        return web.json_response(self._card())

    # ---- completions ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            _room(self.engine, 1)  # a full queue refuses before the body is read
            body = await _json_object(request)
            prompts = self._completion_prompts(body.get("prompt"))
            sampling = _sampling(body, _COMPLETION_NEUTRAL, {"max_new_tokens": _get(body, "max_tokens", 16)})
            returns = _completion_returns(body)
            call = self._call(body, prompts, sampling, "cmpl", returns)
        except OpenAIError as exc:
            return exc.response()
        return await call.run(request, CompletionFormat(self.logprobs, returns))

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise OpenAIError(f"prompt {prompt!r} is not a prompt; send a string, a list of strings, a list of "
                              f"token ids or a list of such lists", "prompt")
        if all(isinstance(p, str) for p in prompt):
            ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt]
        elif all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            ids = prompt
        else:
            raise OpenAIError("prompt mixes strings and token ids; send a list of strings or a list of token-id "
                              "lists", "prompt")
        if not all(ids):
            raise OpenAIError("prompt has an empty prompt (no tokens); send at least one token per prompt", "prompt")
        return ids

    # ---- chat -----------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            _room(self.engine, 1)  # a full queue refuses before the body is read
            body = await _json_object(request)
            prompt = self._chat_prompt(body.get("messages"), _get(body, "chat_template_kwargs", {}, "object"))
            limit = _get(body, "max_completion_tokens", None)
            limit = _get(body, "max_tokens", None) if limit is None else limit
            if limit is None and len(prompt) >= self.engine.max_seq_len:
                raise OpenAIError(f"the prompt ({len(prompt)} tokens) leaves no room under the server's max_seq_len "
                                  f"{self.engine.max_seq_len}; shorten the messages", "messages")
            # absent: as many as fit the context, as SGLang clamps an absent limit to it
            sampling = _sampling(body, _CHAT_NEUTRAL,
                                 {"max_new_tokens": limit if limit is not None else self.engine.max_seq_len - len(prompt)})
            returns = _chat_returns(body, request.headers)
            call = self._call(body, [prompt], sampling, "chatcmpl", returns)
            if call.stream and returns.prompt_ids:  # SGLang's refusals, word for word (sglext ids do stream)
                raise OpenAIError("return_prompt_token_ids is not supported with streaming. Please set stream=false "
                                  "when using return_prompt_token_ids=true.", "return_prompt_token_ids")
            if call.stream and returns.token_ids:
                raise OpenAIError("return_token_ids is not supported with streaming on /v1/chat/completions. Please "
                                  "set stream=false when using return_token_ids=true.", "return_token_ids")
        except OpenAIError as exc:
            return exc.response()
        return await call.run(request, ChatFormat(self.logprobs, returns))

    def _chat_prompt(self, messages, template_kwargs: dict) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(f"messages {messages!r} is not a non-empty list of messages; send e.g. "
                              f'[{{"role": "user", "content": "Hi"}}]', "messages")
        turns = []
        for k, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise OpenAIError(f"messages[{k}] {message!r} is not a message; send an object with a 'role' "
                                  f"string and a 'content'", "messages")
            turns.append({**message, "content": _message_text(message.get("content"), k)})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model's tokenizer has no chat template; send a formatted prompt to "
                              "/v1/completions instead", "messages")
        try:
            text = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True,
                                                      **template_kwargs)
        except Exception as exc:  # jinja2's TemplateError, or a template raising on the messages
            raise OpenAIError(f"the chat template failed on these messages ({type(exc).__name__}: {exc}); "
                              f"send messages the model's template accepts", "messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise OpenAIError("the chat template gave an empty prompt; send at least one message with text",
                              "messages")
        return ids

    # ---- shared ---------------------------------------------------------------------------------

    def _call(self, body: dict, prompts: list[list[int]], sampling: dict, prefix: str, returns: Returns) -> "_Call":
        """The engine requests of one OpenAI request (``n`` per prompt, choice ``i`` of a prompt
        seeded as the module docstring says), validated.

        Raises:
            OpenAIError: a sampling field the engine refuses (``param`` names it), or a prompt
                the engine cannot run (too long, a token id outside the vocabulary).
        """
        n = _get(body, "n", 1)
        if n < 1:
            raise OpenAIError(f"n {n}: must be >= 1 (choices per prompt)", "n")
        params = _parse_sampling(sampling)
        seed = params.sampling_seed
        per_choice = [params if i == 0 or seed is None else
                      msgspec.structs.replace(params, sampling_seed=sample_seed(seed, 0, i)) for i in range(n)]
        rid = f"{prefix}-{uuid.uuid4().hex}"
        rids = [rid] if len(prompts) * n == 1 else [f"{rid}-{k}" for k in range(len(prompts) * n)]
        all_prompts = [p for p in prompts for _ in range(n)]
        all_params = per_choice * len(prompts)
        try:
            for p, sp, r in zip(all_prompts, all_params, rids):
                self.engine.validate(p, sp, r)
        except ValueError as exc:  # too long (naming max_new_tokens, SGLang's max_tokens), or a bad token id
            param = "max_tokens" if "max_new_tokens" in str(exc) else "prompt" if "input_ids" in str(exc) else None
            raise OpenAIError(f"{param}: {exc}" if param else str(exc), param) from None
        stream = _get(body, "stream", False, "bool")
        usage = _get(body, "stream_options", {}, "object").get("include_usage") or False
        if type(usage) is not bool:
            raise OpenAIError(f"stream_options.include_usage {usage!r} is not a boolean; send true or false",
                              "stream_options")
        model = _get(body, "model", self.model_id, "str")
        _room(self.engine, len(all_prompts))  # every choice of every prompt, admitted whole or refused whole
        return _Call(self, rid, model, all_prompts, all_params, rids, n, stream, usage, returns)


class _Call:
    """One OpenAI request's engine requests and how its answer is sent (plain or streamed)."""

    def __init__(self, api: OpenAIApi, rid: str, model: str, prompts: list[list[int]], params: list[SamplingParams],
                 rids: list[str], n: int, stream: bool, include_usage: bool, returns: Returns):
        self.api, self.id, self.model, self.prompts, self.params, self.rids = api, rid, model, prompts, params, rids
        self.n, self.stream, self.include_usage, self.returns = n, stream, include_usage, returns
        self.created = int(time.time())

    def text(self, i: int, c: Completion) -> str:
        sp = self.params[i]  # the stop string or token trimmed, as /generate and SGLang's /v1 answer
        text = answer_text(self.api.tokenizer, c.output_ids, c.matched, sp.skip_special_tokens,
                           sp.spaces_between_special_tokens, sp.no_stop_trim)
        if c.finish_reason is not None:
            return text
        return running_text(text, sp)

    def usage(self, done: dict[int, Completion]) -> dict:
        """OpenAI's ``usage``: each prompt counted once (choice 0 of each), every choice's output."""
        prompt = sum(c.prompt_tokens for i, c in done.items() if i % self.n == 0)
        completion = sum(len(c.output_ids) for c in done.values())
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}

    def sglext(self, done: dict[int, Completion]) -> dict | None:
        """Chat's response-level ``sglext`` token ids (the prompt's, and each choice's output ids),
        those asked for; ``None`` when none is."""
        ext = {"input_ids": self.prompts[0]} if self.returns.sglext_input_ids else {}
        if self.returns.sglext_output_ids:
            ext["output_ids"] = [done[i].output_ids if i in done else [] for i in range(len(self.prompts))]
        return ext or None

    def chunk(self, fmt: Format, choices: list[dict], **extra) -> bytes:
        return sse_event({"id": self.id, "object": fmt.chunk_object, "created": self.created, "model": self.model,
                          "choices": choices, **extra})

    async def run(self, request: web.Request, fmt: Format) -> web.StreamResponse:
        engine, interval = self.api.engine, self.api.stream_interval
        if not self.stream:
            try:
                done = await run_requests(engine, self.prompts, self.params, self.rids, None, _ignore)
            except NonFiniteLogprobs as exc:  # broken weights (the other requests are aborted)
                return OpenAIError(str(exc), status=500).response()
            except QueueFull as exc:  # other calls filled the queue since _call checked it
                return OpenAIError(str(exc), status=503).response()
            except EngineFailed as exc:  # the engine died under it
                return OpenAIError(str(exc), status=500).response()
            except ValueError as exc:  # a rid taken since validation (not one a client chose: cannot happen)
                return OpenAIError(str(exc)).response()
            choices = [fmt.choice(i, self.text(i, c), c, self.prompts[i]) for i, c in enumerate(done)]
            answer = {"id": self.id, "object": fmt.object, "created": self.created, "model": self.model,
                      "choices": choices, "usage": self.usage(dict(enumerate(done))),
                      "metadata": {"weight_version": str(done[0].weight_version)}}
            ext = self.sglext(dict(enumerate(done)))
            return web.json_response(answer if ext is None else {**answer, "sglext": ext})
        response = await start_sse(request)
        sent: dict[int, str] = {}  # each choice's text streamed so far
        carried: dict[int, int] = {}  # each choice's tokens whose log-probs and ids were sent
        done: dict[int, Completion] = {}

        async def emit(i: int, c: Completion) -> None:
            first, text, before = i not in sent, self.text(i, c), sent.get(i, "")
            # a running text is a prefix of every later one (streaming.running_text); were one not,
            # its new part would wait for a text that extends what was sent
            delta = text[len(before):] if text.startswith(before) else ""
            sent[i] = before + delta
            if c.finish_reason is not None:
                done[i] = c
            new = None  # the tokens this update's chunks carry: all not carried yet, if it carries any
            if fmt.carries(delta, c):
                new, carried[i] = slice(carried.get(i, 0), len(c.output_ids)), len(c.output_ids)
            for event in fmt.stream_events(i, first, delta, c, new, self.prompts[i]):
                await response.write(self.chunk(fmt, [event]))

        try:
            await run_requests(engine, self.prompts, self.params, self.rids, interval, emit)
            ext = self.sglext(done)
            if ext is not None:  # SGLang's order: after every choice's last chunk, before the usage
                event = self.chunk(fmt, [], sglext=ext)
                await response.write(b"event: sglext_ids\n" + event if self.returns.ids_framed else event)
            if self.include_usage:
                await response.write(self.chunk(fmt, [], usage=self.usage(done)))
        except ConnectionResetError:  # the client went away; its requests were aborted
            return response
        except (ValueError, NonFiniteLogprobs, QueueFull, EngineFailed) as exc:
            status = 503 if isinstance(exc, QueueFull) else 400 if isinstance(exc, ValueError) else 500
            await response.write(sse_event(OpenAIError(str(exc), status=status).body()))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


def _room(engine: Engine, asked: int) -> None:
    """``engine.check_room(asked)``, its ``QueueFull`` as an ``OpenAIError`` of status 503 (a dead
    engine's ``EngineFailed``: 500)."""
    try:
        engine.check_room(asked)
    except QueueFull as exc:
        raise OpenAIError(str(exc), status=503) from None
    except EngineFailed as exc:
        raise OpenAIError(str(exc), status=500) from None


async def _ignore(index: int, completion: Completion) -> None:
    """``run_requests``' emit for an answer that is not streamed (it only collects the completions)."""


async def _json_object(request: web.Request) -> dict:
    try:
        return await fields.json_object(request)
    except ValueError as exc:
        raise OpenAIError(str(exc)) from None


def _get(body: dict, key: str, default, kind: str = "int"):
    """``body[key]`` of JSON type ``kind`` (a key of ``fields.KINDS``; ``true`` is not an
    integer); absent or null: ``default``.

    Raises:
        OpenAIError: another type, naming the field (``fields.field``'s message).
    """
    try:
        return fields.field(body, key, kind, default, send=f"{fields.KINDS[kind][1]} (or leave {key} out)")
    except ValueError as exc:
        raise OpenAIError(str(exc), key) from None


def _sampling(body: dict, neutral: dict, extra: dict) -> dict:
    """SGLang's ``sampling_params`` for an OpenAI request: ``extra`` plus the ``_SAMPLING`` fields
    present (absent and null ones keep SGLang's defaults).

    Raises:
        OpenAIError: a field of ``neutral`` at a value this server cannot honour, naming it.
    """
    for key, allowed in neutral.items():
        head, _, tail = key.partition(".")
        value = body.get(head)
        if tail:
            value = value.get(tail) if isinstance(value, dict) else None
        if allowed is not None and value not in allowed:
            neutral_values = " or ".join("null" if a is None else repr(a) for a in allowed)
            raise OpenAIError(f"{key} {value!r} is not supported by this server; leave it out (or send "
                              f"{neutral_values})", key)
    sampling = {sgl: body[key] for key, sgl in _SAMPLING.items() if body.get(key) is not None}
    return {**sampling, **extra}


def _no_top_logprobs(key: str, value: int, send: str) -> None:
    """Refuse ``value`` of ``key`` (a count of top alternatives per token) unless it is 0.

    Raises:
        OpenAIError: negative, or positive (the engine computes only the sampled token's log-prob).
    """
    if value < 0:
        raise OpenAIError(f"{key} {value} is negative; send {send}", key)
    if value > 0:
        raise OpenAIError(f"{key} {value} asks for the {value} most likely tokens at each position, which this "
                          f"server does not compute (its engine returns the sampled token's log-prob only, the "
                          f"one /generate returns); send {send}", key)


def _completion_returns(body: dict) -> Returns:
    """``/v1/completions``' ``logprobs`` (an integer: top alternatives per token; 0 for none, the
    only count served) and ``return_token_ids``."""
    logprobs = _get(body, "logprobs", None)
    if logprobs is not None:
        _no_top_logprobs("logprobs", logprobs, "0 for each sampled token's log-prob (or leave logprobs out)")
    return Returns(logprobs=logprobs is not None, token_ids=_get(body, "return_token_ids", False, "bool"))


def _chat_returns(body: dict, headers) -> Returns:
    """``/v1/chat/completions``' ``logprobs`` (a boolean) with ``top_logprobs`` (0 only, or any
    count when ``logprobs`` is false: nothing is returned then, as on SGLang), the token-id fields
    and headers."""
    logprobs = _get(body, "logprobs", False, "bool")
    top = _get(body, "top_logprobs", 0)
    if logprobs or top < 0:
        _no_top_logprobs("top_logprobs", top, "0 (or leave top_logprobs out): each token's entry then has "
                                              "top_logprobs []")
    return Returns(
        logprobs=logprobs, token_ids=_get(body, "return_token_ids", False, "bool"),
        prompt_ids=_get(body, "return_prompt_token_ids", False, "bool"),
        sglext_input_ids=_get(body, "return_input_ids_in_sglext", False, "bool")
        or headers.get("x-sglext-return-input-ids") == "1",
        sglext_output_ids=_get(body, "return_output_ids_in_sglext", False, "bool")
        or headers.get("x-sglext-return-output-ids") == "1",
        ids_framed=headers.get("x-sglext-ids-framed") == "1")


def _parse_sampling(sampling: dict) -> SamplingParams:
    """``decode_sampling(sampling)``; its refusal becomes an ``OpenAIError`` naming the OpenAI
    field that caused it (found by parsing each field alone)."""
    try:
        return decode_sampling(sampling)
    except ValueError as exc:
        message = str(exc)
    names = {sgl: key for key, sgl in _SAMPLING.items()} | {"max_new_tokens": "max_tokens"}
    for sgl, value in sampling.items():
        try:
            decode_sampling({sgl: value})
        except ValueError:
            raise OpenAIError(f"{names.get(sgl, sgl)}: {message}", names.get(sgl, sgl)) from None
    raise OpenAIError(message)


def _message_text(content, k: int) -> str:
    """A chat message's ``content`` as text: a string, null (""), or a list of ``text`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type") for part in content}
        if kinds <= {"text"} and all(isinstance(part.get("text"), str) for part in content):
            return "".join(part["text"] for part in content)
        raise OpenAIError(f"messages[{k}].content has parts of type {sorted(map(str, kinds - {'text'}))}; this "
                          f"server takes text only: send the content as a string or as text parts", "messages")
    raise OpenAIError(f"messages[{k}].content {content!r} is not a string or a list of content parts", "messages")
