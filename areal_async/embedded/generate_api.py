"""SGLang's ``/generate`` over the engine: ``GenerateApi``.

``input_ids`` or ``text``, single or batch, one ``sampling_params`` for all or one per prompt,
decoded with SGLang 0.5.23's meaning by ``request.py`` (exact JSON types, ``fields.py``; a missing
or null field takes SGLang's default; stop strings, ``min_new_tokens``, ``ignore_eos``,
``max_new_tokens: 0`` prefill-only, ``logprob_start_len`` → ``meta_info.input_token_logprobs``,
``e2e_latency``). ``rid`` is a string
(one prompt) or a list of distinct strings (a batch), never one an unfinished request holds.
``stream: true`` sends SGLang's server-sent events, one cumulative chunk per request every
``--stream-interval`` tokens (``_generate_stream``, ``streaming.py``).

Answers besides the result: bad input is HTTP 400 naming the field; a call finding
``--max-queued-requests`` requests already waiting for a KV slot is 503 with ``Retry-After``
(``admission.py``); a generation whose log-probs are not all finite (broken weights) is 500
naming the rid and the weight version, whether or not log-probs were asked for; a dead engine
(``EngineFailed``) is 500; each with the ``errors.py`` body, or, once a stream has begun, as its
error event before ``[DONE]``. A batch is admitted whole or refused whole; a client that
disconnects, or one prompt that fails, cancels the call, which aborts its requests in the engine.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from .engine import stop
from .engine.admission import QueueFull
from .engine.engine import Engine
from .engine.requests import Completion, EngineFailed
from .errors import error, json_body, overloaded
from .request import GenerateCall, Prompt, check_lora_path, parse_generate
from .streaming import (SSE_DONE, NonFiniteLogprobs, non_finite, run_requests, running_text, sse_error, sse_event,
                        start_sse)


class GenerateApi:
    """The ``/generate`` handler over ``engine``; ``stream_interval``: tokens per streamed chunk."""

    def __init__(self, engine: Engine, tokenizer, stream_interval: int = 1):
        self.engine, self.tokenizer, self.stream_interval = engine, tokenizer, stream_interval

    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()  # meta_info.e2e_latency counts from here, as SGLang's from receipt
        try:
            # a full queue refuses before the body is read: under a flood, refusals cost no memory
            self.engine.check_room()
            call = self.parse(await json_body(request))
            self.engine.check_room(len(call.prompts))  # a batch is admitted whole or refused whole
        except QueueFull as exc:
            return overloaded(exc)
        except EngineFailed as exc:  # a dead engine refuses before the body is read
            return error(str(exc), status=500)
        except ValueError as exc:
            return error(str(exc))
        if call.stream:
            return await self._generate_stream(request, call, received)
        # Cancelled when the client disconnects, and if one prompt fails: the task group then
        # cancels every other generate, which aborts its request (no slot is left to nobody).
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self._run(p)) for p in call.prompts]
        except ExceptionGroup as failed:
            first = failed.exceptions[0]  # the first prompt's error, as a single call raises it
            if isinstance(first, QueueFull):  # other calls filled the queue since the check above
                return overloaded(first)
            if isinstance(first, ValueError):  # its rid was taken by a request queued since the check
                return error(str(first))
            if isinstance(first, EngineFailed):  # the engine died under it
                return error(str(first), status=500)
            raise first from None
        done = [t.result() for t in running]
        broken = non_finite([c for c, _ in done], [p.rid for p in call.prompts])
        if broken:
            return error(broken, status=500)
        latency = time.perf_counter() - received
        out = [self._response(c, p, inputs, call.return_text_in_logprobs, latency)
               for (c, inputs), p in zip(done, call.prompts)]
        return web.json_response(out if call.batch else out[0])

    async def _generate_stream(self, request: web.Request, call: GenerateCall, received: float) -> web.StreamResponse:
        """SGLang's streamed ``/generate``: one server-sent event ``data: {chunk}`` per request per
        stream interval, then ``data: [DONE]``. A chunk is cumulative, as SGLang's default (not
        ``--incremental-streaming-output``): the request's ``text``, ``output_ids`` and ``meta_info``
        so far (``finish_reason`` null until its last chunk, which is the answer a request that is
        not streamed gets), its ``text`` held back so that it is a prefix of the final one
        (``streaming.running_text``; SGLang withholds the whole chunk instead while its text ends in
        a stop string's beginning); a batch's chunks carry the prompt's ``index``. An error once
        streaming has begun is an event ``{"error": {...}}`` before ``[DONE]``, as SGLang sends it."""
        response = await start_sse(request)
        prompts = call.prompts

        async def emit(i: int, c: Completion) -> None:
            out = self._response(c, prompts[i], inputs[i], call.return_text_in_logprobs,
                                 time.perf_counter() - received)
            if c.finish_reason is None:
                out["meta_info"]["finish_reason"] = None
                out["text"] = running_text(out["text"], prompts[i].params)  # a prefix of the final text
            if call.batch:
                out["index"] = i
            await response.write(sse_event(out))

        try:
            inputs = [await self._input_logprobs(p) for p in prompts]
            await run_requests(self.engine, [p.input_ids for p in prompts], [p.params for p in prompts],
                               [p.rid for p in prompts], self.stream_interval, emit)
        except ConnectionResetError:  # the client went away; its requests were aborted
            return response
        except QueueFull as exc:  # filled by other calls since the check before the headers went out
            await response.write(sse_error(str(exc), 503))
        except (ValueError, NonFiniteLogprobs, EngineFailed) as exc:
            await response.write(sse_error(str(exc), 400 if isinstance(exc, ValueError) else 500))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    async def _input_logprobs(self, prompt: Prompt) -> list[float | None] | None:
        """With ``return_logprob`` and ``logprob_start_len >= 0``, the prompt's log-probs
        (``Engine.prompt_logprobs``), else ``None``."""
        if prompt.return_logprob and prompt.logprob_start_len >= 0:
            return await self.engine.prompt_logprobs(prompt.input_ids, prompt.logprob_start_len)
        return None

    async def _run(self, prompt: Prompt) -> tuple[Completion, list[float | None] | None]:
        """Generate ``prompt``, with its prompt log-probs when asked for (``_input_logprobs``)."""
        inputs = await self._input_logprobs(prompt)
        return await self.engine.generate(prompt.input_ids, prompt.params, prompt.rid), inputs

    def parse(self, body: dict) -> GenerateCall:
        """A ``/generate`` body decoded for this server's engine (``request.parse_generate``)."""
        check_lora_path(body, self.engine.adapter.name if self.engine.adapter is not None else None)
        return parse_generate(body, self.engine.max_seq_len, self._tokenize, self.engine.validate)

    def _tokenize(self, text: str | list[str]) -> list[int] | list[list[int]]:
        """``text`` (one prompt, or a list for a batch) as token ids; raises ``ValueError`` for a
        prompt with no tokens (the engine would name ``input_ids``, which the caller did not send)."""
        texts = [text] if isinstance(text, str) else text
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        empty = [t for t, p in zip(texts, ids) if not p]
        if empty:
            raise ValueError(f"text {empty[0]!r} has no tokens; send at least one character of prompt")
        return ids[0] if isinstance(text, str) else ids

    def _logprob_entries(self, logprobs: list[float | None], ids: list[int], with_text: bool) -> list[list]:
        """SGLang's ``[logprob, token_id, text]`` entries (``text`` the token's own decoding with
        ``return_text_in_logprobs``, else ``None``)."""
        texts = self.tokenizer.batch_decode([[t] for t in ids]) if with_text and ids else [None] * len(ids)
        return [[lp, t, s] for lp, t, s in zip(logprobs, ids, texts)]

    def _response(self, c: Completion, prompt: Prompt, inputs: list[float | None] | None, with_text: bool,
                  e2e_latency: float) -> dict:
        """SGLang's answer for one prompt: ``text`` (stop trimmed as its detokenizer does),
        ``output_ids`` (every generated token, the stop token or the token completing a stop string
        included) and ``meta_info`` (SGLang's keys that apply; log-probs with ``return_logprob``)."""
        params = prompt.params
        finish = {"type": c.finish_reason}
        if c.finish_reason == "stop":
            finish["matched"] = c.matched
        elif c.finish_reason == "length":
            finish["length"] = len(c.output_ids)
        elif c.finish_reason == "abort":
            finish["message"] = "aborted"
        meta = {
            "id": prompt.rid,
            "finish_reason": finish,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids),
            "cached_tokens": c.cached_tokens,
            "weight_version": str(c.weight_version),
            "e2e_latency": e2e_latency,
        }
        if prompt.return_logprob:
            ids = prompt.input_ids[prompt.logprob_start_len:] if inputs is not None else []
            meta["input_token_logprobs"] = self._logprob_entries(inputs or [], ids, with_text)
            meta["output_token_logprobs"] = self._logprob_entries(c.logprobs, c.output_ids, with_text)
            meta["output_token_logprobs_length"] = len(c.output_ids)
        # SGLang's detokenizer drops a matched stop token from the text unless no_stop_trim, and
        # cuts the text at a matched stop string
        text = stop.answer_text(self.tokenizer, c.output_ids, c.matched, params.skip_special_tokens,
                                params.spaces_between_special_tokens, params.no_stop_trim)
        return {"text": text, "output_ids": c.output_ids, "meta_info": meta}
