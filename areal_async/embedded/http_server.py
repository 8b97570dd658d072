"""The embedded inference server's HTTP side: SGLang's HTTP endpoints (same JSON shapes) over ``Engine``.

``InferenceServer`` holds the handlers around one ``Engine`` and builds the aiohttp application;
``serve`` runs it inside the running loop. The process's command line (flags, start, stop) is
``server.py``; ``loading.py`` builds the ``Engine`` from an HF directory.

Access (``areal_async/auth.py``): with a token (``--api-key``, SGLang's flag, or the job's
``AREAL_ASYNC_TOKEN``, which ``launcher.local`` sets) every endpoint but ``/health*`` and ``/ready`` needs
``Authorization: Bearer <token>``, as SGLang's ``--api-key`` does; without one, or a wrong one,
the answer is HTTP 401 and the body is not read. Without a token the server starts only on a
loopback ``--host``. A request body over ``--max-request-bytes`` (16 MiB by default, far above a
batch of long prompts or a weight bucket's names and shapes) is HTTP 413. A ``/generate`` or ``/v1``
call finding ``--max-queued-requests`` requests already waiting for a KV slot is HTTP 503 with
``Retry-After`` (``admission.py``, SGLang's flag; ``/health_generate`` is never refused, and
answers 200 once its one-token generation ends or, as SGLang's, once any step of other requests
commits (here: with finite log-probs; 503 otherwise), so a server whose slots are all busy answers
without waiting for one; at once while generation is paused or a weight update waits). An engine
whose loop died (``EngineFailed``) is SGLang's unhealthy server: ``/health*`` and ``/ready`` are 503,
every request HTTP 500 (a stream: an error event), each with the error body naming the cause. The
listen backlog is SGLang's, 2048: a burst of that many connections waits in the kernel, none for a
SYN retransmission.

Implemented subset (see docs/sglang_api.md): ``/generate`` (``input_ids`` or ``text``, single or batch,
one ``sampling_params`` for all or one per prompt; ``stream: true`` sends SGLang's server-sent
events, one cumulative chunk per request every ``--stream-interval`` tokens, see
``_generate_stream``; decoded with SGLang 0.5.23's
meaning by ``request.py``: stop strings, ``min_new_tokens``, ``ignore_eos``, ``max_new_tokens: 0``
prefill-only, ``logprob_start_len`` → ``meta_info.input_token_logprobs``, ``e2e_latency``),
``/health``, ``/health_generate``, ``/ready`` (503 while paused or dead, as SGLang), ``/get_model_info``, ``/get_server_info`` (and ``/server_info``),
``/get_weight_version``, ``/flush_cache`` (empties the prefix cache; 400 while requests run, as
SGLang), ``/pause_generation`` (``abort`` | ``in_place``), ``/continue_generation``,
``/abort_request``, ``/init_weights_update_group``, ``/update_weights_from_distributed`` (gloo or
NCCL broadcast from rank 0 in ``names`` order, or SGLang's ``flattened_bucket``; the group is built
as SGLang builds it, ``weight_group``), ``/destroy_weights_update_group`` (``{group_name}``; as
SGLang 0.5.23: ``{success, message}``, HTTP 400 "The group to be destroyed does not exist." for a
name it holds no group of; the trainer calls it when it rebuilds its group),
``/update_weights_from_disk`` (an HF safetensors directory), and the OpenAI-compatible
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (``openai_api.py``; the model id is
``--served-model-name``, by default ``--model-path``, as on SGLang).
Bad input is HTTP 400 with ``{"error": {"message": ...}}`` (the weight endpoints answer
SGLang's ``{"success": false, "message": ...}``), naming the field; fields have exact JSON types
(``fields.py``: ``return_logprob`` is ``true``/``false``, never ``"false"``; the two weight-group endpoints read
their scalars as SGLang's schemas do, ``"29612"`` as a port: ``weight_requests``;
``text`` a string or a list of strings; a missing or null field takes SGLang's default, e.g.
``group_name`` ``"weight_update_group"``). ``rid`` is a string (one prompt) or a list of distinct
strings (a batch, one per prompt), never one an unfinished request holds; ``weight_version`` an
integer below 2**63 (SGLang sends it as a string, ``"3"``) that never goes back: a version behind
the server's is refused before any tensor is read or received (the current one is accepted: each
bucket of a distributed update carries it). A weight update of a server that is not paused waits as
SGLang's does (its model-update lock): the requests unfinished when it arrives end under the old
weights, requests arriving meanwhile wait and run under the new ones; a paused server swaps at once
(``Engine.update_weights``). A generation whose
log-probs are not all finite (broken weights) is HTTP 500 with that body, naming the rid and the
weight version, whether or not log-probs were asked for; ``/health_generate`` is then 503.

A ``/generate`` (streamed or not, or a ``/v1`` request) whose client disconnects is cancelled
(aiohttp's ``handler_cancellation``; a streamed one also stops at its first write to the closed
connection), which aborts its requests in the engine; weight updates run in their own task, so a disconnect never
leaves one half-applied. ``/init_weights_update_group`` joins the group in a daemon thread: on
SIGTERM the server answers a join still waiting for peers with 503 and exits without waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import pathlib
import time
import uuid

import torch
from aiohttp import web
from safetensors.torch import load_file

from .. import auth, weight_group
from ..dtypes import dtype_from_name, dtype_name
from .engine.admission import QueueFull, retry_after_headers
from .engine.engine import Completion, Engine, EngineFailed
from . import fields
from . import weight_requests
from .engine.forward import check_weight_names
from .engine import stop
from .openai_api import OpenAIApi
from .request import GenerateCall, Prompt, parse_generate
from .engine.sampling import SamplingParams
from .streaming import (SSE_DONE, NonFiniteLogprobs, non_finite, run_requests, running_text, sse_error, sse_event,
                        start_sse)

SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP API (and request schema) this server follows
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # default body limit (HTTP 413 above it)
# connections the kernel completes before the server accepts them: SGLang's (uvicorn's default);
# aiohttp's 128 makes the 129th of a burst of clients wait a second for a SYN retransmission
LISTEN_BACKLOG = 2048
_log = logging.getLogger(__name__)


def _project_version() -> str:
    """This project's installed version (``/server_info``), or ``"unknown"`` when run from a checkout
    that is not installed."""
    try:
        return importlib.metadata.version("areal-async")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error_json(message: str) -> str:
    """The body of every error answer, SGLang's ``{"error": {"message": ...}}``, as JSON text."""
    return json.dumps({"error": {"message": message}})


def _error(message: str, status: int = 400) -> web.Response:
    """An error answer for a handler to return: HTTP ``status`` with the ``_error_json`` body."""
    return web.Response(text=_error_json(message), status=status, content_type="application/json")


def _bad_request(message: str) -> web.HTTPBadRequest:
    """HTTP 400 with the ``_error_json`` body, for code that raises rather than returns (``_body``)."""
    return web.HTTPBadRequest(text=_error_json(message), content_type="application/json")


def _overloaded(exc: QueueFull) -> web.Response:
    """HTTP 503 with ``Retry-After`` for a call the waiting queue has no room for (``admission.py``)."""
    return web.Response(text=_error_json(str(exc)), status=503, content_type="application/json",
                        headers=retry_after_headers())


def _result(success: bool, message: str, **extra) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def _shutting_down(what: str) -> web.Response:
    return web.json_response({"success": False, "message": f"{what} abandoned: the server is shutting down"},
                             status=503)


async def _body(request: web.Request) -> dict:
    try:
        return await fields.json_object(request, allow_empty=True)
    except ValueError as exc:
        raise _bad_request(str(exc)) from None


class InferenceServer:
    """HTTP handlers around one ``Engine``; ``app()`` builds the aiohttp application.

    ``token``: required as ``Authorization: Bearer <token>`` on every path but ``/health*`` and ``/ready``
    (``None``: no check); ``max_request_bytes``: the body limit, HTTP 413 above it.
    """

    def __init__(self, engine: Engine, tokenizer, model_path: str, stream_interval: int = 1,
                 served_model_name: str | None = None, token: str | None = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        if stream_interval < 1:
            raise ValueError(f"stream_interval {stream_interval}: must be >= 1 (tokens per streamed chunk)")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes {max_request_bytes}: must be >= 1 (the request body limit in bytes)")
        self.token, self.max_request_bytes = token, max_request_bytes
        self.engine, self.tokenizer, self.model_path = engine, tokenizer, model_path
        self.stream_interval = stream_interval
        self.openai = OpenAIApi(engine, tokenizer, served_model_name or model_path, stream_interval)
        self.groups: dict = {}
        self._task: asyncio.Task | None = None
        self._closing = asyncio.Event()  # set when the application starts shutting down
        self._updates: set[asyncio.Task] = set()  # weight updates in flight (the loop holds tasks weakly)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes,
                              middlewares=[self._check_token] if self.token is not None else [])
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        routes = [
            ("POST", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health_generate),
            ("GET", "/ready", self.ready),
            ("GET", "/get_model_info", self.get_model_info),
            ("GET", "/get_server_info", self.get_server_info),
            ("GET", "/server_info", self.get_server_info),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/flush_cache", self.flush_cache),
            ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("GET", "/v1/models", self.openai.models),
            ("GET", "/v1/models/{model:.+}", self.openai.model),
            ("POST", "/v1/completions", self.openai.completions),
            ("POST", "/v1/chat/completions", self.openai.chat_completions),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    @web.middleware
    async def _check_token(self, request: web.Request, handler) -> web.StreamResponse:
        # before the handler reads the body: a caller without the token changes nothing
        if request.path.startswith(auth.OPEN_PREFIXES) or auth.bearer_ok(request.headers.get(auth.HEADER), self.token):
            return await handler(request)
        return _error("Unauthorized: send the job's token as 'Authorization: Bearer <token>' (AREAL_ASYNC_TOKEN)",
                      status=401)

    async def _start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self.engine.run(), name="engine")

    async def _shutdown(self, app: web.Application) -> None:
        # runs before aiohttp waits for the handlers in flight: a join waiting for peers gives up
        self._closing.set()

    async def _stop(self, app: web.Application) -> None:
        for update in list(self._updates):  # abandoned by their handlers at shutdown
            update.cancel()
        await asyncio.gather(*self._updates, return_exceptions=True)
        while self.groups:  # their names are the process's (torch's registry): free them for a next server
            weight_group.destroy_weight_group(self.groups.popitem()[1])
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    @property
    def engine_task(self) -> asyncio.Task | None:
        return self._task

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()  # meta_info.e2e_latency counts from here, as SGLang's from receipt
        try:
            # a full queue refuses before the body is read: under a flood, refusals cost no memory
            self.engine.check_room()
            call = self._parse_generate(await _body(request))
            self.engine.check_room(len(call.prompts))  # a batch is admitted whole or refused whole
        except QueueFull as exc:
            return _overloaded(exc)
        except EngineFailed as exc:  # a dead engine refuses before the body is read
            return _error(str(exc), status=500)
        except ValueError as exc:
            return _error(str(exc))
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
                return _overloaded(first)
            if isinstance(first, ValueError):  # its rid was taken by a request queued since the check
                return _error(str(first))
            if isinstance(first, EngineFailed):  # the engine died under it
                return _error(str(first), status=500)
            raise first from None
        done = [t.result() for t in running]
        broken = non_finite([c for c, _ in done], [p.rid for p in call.prompts])
        if broken:
            return _error(broken, status=500)
        latency = time.perf_counter() - received
        out = [self._response(c, p, inputs, call.return_text_in_logprobs, latency)
               for (c, inputs), p in zip(done, call.prompts)]
        return web.json_response(out if call.batch else out[0])

    async def _generate_stream(self, request: web.Request, call: GenerateCall, received: float) -> web.StreamResponse:
        """SGLang's streamed ``/generate``: one server-sent event ``data: {chunk}`` per request per
        stream interval, then ``data: [DONE]``. A chunk is cumulative, as SGLang's default (not
        ``--incremental-streaming-output``): the request's ``text``, ``output_ids`` and ``meta_info``
        so far (``finish_reason`` null until its last chunk, which is the answer a request that is
        not streamed gets); a batch's chunks carry the prompt's ``index``. An error once streaming
        has begun is an event ``{"error": {...}}`` before ``[DONE]``, as SGLang sends it."""
        response = await start_sse(request)
        prompts = call.prompts

        async def emit(i: int, c: Completion) -> None:
            out = self._response(c, prompts[i], inputs[i], call.return_text_in_logprobs,
                                 time.perf_counter() - received)
            if c.finish_reason is None:
                out["meta_info"]["finish_reason"] = None
                out["text"] = running_text(out["text"])
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

    def _parse_generate(self, body: dict) -> GenerateCall:
        """A ``/generate`` body decoded for this server's engine (``request.parse_generate``)."""
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

    async def health(self, request: web.Request) -> web.Response:
        # SGLang's 503 for an unhealthy server: a dead engine serves nothing more
        if self.engine.failure is not None:
            return _error(str(self.engine.failure), status=503)
        return web.Response(text="")

    async def ready(self, request: web.Request) -> web.Response:
        # SGLang's /ready: 503 while generation is paused (pause_generation) or the server is
        # unhealthy (here: its engine died), at once
        if self.engine.failure is not None:
            return _error(str(self.engine.failure), status=503)
        return web.Response(status=503 if self.engine.paused else 200, text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.failure is not None:
            return _error(str(self.engine.failure), status=503)
        if self.engine.holding:  # paused or updating weights on purpose: alive, and no step is due
            return web.Response(text="")
        start = next(iter(self.engine.eos_token_ids), 0)
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        rid = f"health-{uuid.uuid4().hex}"
        # not bounded by max_queued_requests: a busy server is alive, and says so
        probe = asyncio.ensure_future(self.engine.generate([start], params, rid, bounded=False))
        # as SGLang's: a step of other requests committed meanwhile proves the server alive too, so a
        # server whose slots are all taken by long generations answers without waiting for a slot;
        # unlike SGLang's, only a step whose log-probs are finite proves it healthy
        progress = asyncio.ensure_future(self.engine.next_step())
        try:
            await asyncio.wait([probe, progress], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for work in (probe, progress):
                if not work.done():
                    work.cancel()  # the probe's request is aborted (Engine.generate)
        if self.engine.failure is not None:  # it died meanwhile: the probe and the step raise its error
            for work in (probe, progress):
                if work.done() and not work.cancelled():
                    work.exception()  # read here, so asyncio does not log it as never retrieved
            return _error(str(self.engine.failure), status=503)
        if probe.done():  # its own generation; SGLang answers 503 when that fails
            broken = non_finite([probe.result()], [rid])
            return _error(broken, status=503) if broken else web.Response(text="")
        step = progress.result()
        if step.finite:
            return web.Response(text="")
        return _error(f"a step of the running requests committed non-finite log-probs (NaN or inf) under weight "
                      f"version {step.weight_version}: those weights are broken (e.g. a diverged training step); "
                      f"load good weights, e.g. a version from before the divergence", status=503)

    # ---- info and flow control ------------------------------------------------------------------

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": str(self.engine.weight_version),
            "max_running_requests": self.engine.max_running,
            "max_seq_len": self.engine.max_seq_len,
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/server_info`` (and its deprecated alias ``/get_server_info``): the keys of its
        ``ServerArgs`` and scheduler info that apply to this server, under SGLang's names;
        ``version`` is this project's (``sglang_api_version`` the SGLang release whose API it
        follows)."""
        engine, forward = self.engine, self.engine.forward
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_path,
            "dtype": dtype_name(forward.dtype),
            "device": forward.device.type,
            "context_length": engine.max_seq_len,
            "max_context_length": engine.max_seq_len,
            "max_req_input_len": engine.max_seq_len - 1,
            "max_running_requests": engine.max_running,
            "max_prefill_tokens": engine.max_prefill_tokens,
            "max_queued_requests": engine.max_queued,
            "max_total_num_tokens": engine.max_running * engine.max_seq_len,
            "disable_radix_cache": not engine.share_prompts,
            "enable_deterministic_inference": forward.batch_invariant,
            "disable_cuda_graph": forward.graphs is None,
            "skip_tokenizer_init": False,
            "is_embedding": False,
            "weight_version": str(engine.weight_version),
            "internal_states": [{"num_running_reqs": engine.num_running}],
            "version": _project_version(),
            "sglang_api_version": SGLANG_API_VERSION,
            "frontend": "areal-async-embedded",
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_running:
            return web.Response(status=400, text="Cache not flushed: requests are running.")
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            await self.engine.pause(fields.field(await _body(request), "mode", "str", "abort"))
        except EngineFailed as exc:
            return _error(str(exc), status=500)
        except ValueError as exc:
            return _error(str(exc))
        return web.json_response({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.continue_generation()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            rid = None if fields.field(body, "abort_all", "bool", False) else fields.field(
                body, "rid", "str", send='one request id as a string, {"rid": "..."}, or {"abort_all": true}')
        except ValueError as exc:
            return _error(str(exc))
        n = self.engine.abort(rid)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)"})

    # ---- weights --------------------------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            join = weight_requests.parse_join(await _body(request))
        except ValueError as exc:
            return _result(False, f"init_weights_update_group failed: ValueError: {exc}")
        old = self.groups.pop(join.group_name, None)
        if old is not None:  # a trainer joining again (it restarted): the old group has no sender left
            weight_group.destroy_weight_group(old)
        joining = weight_group.in_daemon_thread(functools.partial(
            weight_group.new_weight_group, join.backend, join.master_address, join.master_port, join.rank_offset,
            join.world_size, group_name=join.group_name))
        if not await self._unless_closing(joining):
            return _shutting_down("init_weights_update_group")
        try:
            group = joining.result()
        except (ValueError, RuntimeError) as exc:  # torch's DistError (a peer never came) is a RuntimeError
            message = f"init_weights_update_group failed: {type(exc).__name__}: {exc}"
            _log.warning("%s", message)
            return _result(False, message)
        self.groups[join.group_name] = group
        return _result(True, f"joined weight group '{join.group_name}'")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        # SGLang 0.5.23's answers: 200 {success: true}, or 400 {success: false} naming why
        try:
            name = weight_requests.parse_destroy(await _body(request))
        except ValueError as exc:
            return _result(False, f"destroy_weights_update_group failed: ValueError: {exc}")
        group = self.groups.pop(name, None)
        if group is None:
            return _result(False, "The group to be destroyed does not exist.")
        # a receive still blocked in it keeps it alive until the trainer's side closes (weight_group)
        weight_group.destroy_weight_group(group)
        return _result(True, f"destroyed weight group '{name}'")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            bucket = weight_requests.parse_bucket(body)
            version = fields.weight_version(bucket.weight_version, self.engine.weight_version)
            # flush_cache is read but not obeyed: every weight update flushes the prefix cache (stale
            # keys and values are never right)
            group = self.groups.get(bucket.group_name)
            if group is None:
                joined = ", ".join(f"'{g}'" for g in self.groups) or "none yet"
                raise ValueError(f"no weight group '{bucket.group_name}' (joined: {joined}); call "
                                 f"/init_weights_update_group with group_name '{bucket.group_name}' first, or "
                                 f"send the group_name of a joined group")
            names = bucket.names
            check_weight_names(self.engine.forward.named_tensors(), dict(zip(names, map(tuple, bucket.shapes))))
            received, tensors = weight_group.receive_buffers(
                [dtype_from_name(d, what="weight dtype") for d in bucket.dtypes], bucket.shapes,
                self.engine.forward.device, flattened=bucket.load_format == "flattened_bucket")
        except ValueError as exc:
            return _result(False, f"update_weights_from_distributed rejected: {type(exc).__name__}: {exc}")

        def receive() -> dict[str, torch.Tensor]:
            weight_group.broadcast_(group, received, src=0)
            return dict(zip(names, tensors))

        return await self._update(receive, version, bucket.abort_all_requests)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            version = fields.weight_version(body.get("weight_version"), self.engine.weight_version)
            abort_all = fields.field(body, "abort_all_requests", "bool", False)
        except ValueError as exc:
            return _result(False, f"update_weights_from_disk rejected: {exc}", num_paused_requests=0)
        raw = body.get("model_path")
        if not isinstance(raw, str) or not raw:
            return _result(False, f"model_path {raw!r} is not a directory path; send the HF directory holding the "
                                  f"*.safetensors weights", num_paused_requests=0)
        path = pathlib.Path(raw)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return _result(False, f"model_path '{path}' has no *.safetensors files", num_paused_requests=0)

        def receive() -> dict[str, torch.Tensor]:
            tensors: dict[str, torch.Tensor] = {}
            for f in files:
                try:
                    tensors.update(load_file(str(f)))
                except Exception as exc:  # safetensors raises its own SafetensorError (header, truncation)
                    raise ValueError(f"{f} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                                     f"write the directory again") from exc
            expected = {name for name, _ in self.engine.forward.model.named_parameters()}  # tied ones once
            missing = sorted(expected - tensors.keys())
            if missing:
                raise ValueError(f"{path} holds {len(expected) - len(missing)} of the model's {len(expected)} "
                                 f"weights (missing {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                 f"a weight update from disk replaces every weight: write the whole model")
            return tensors

        return await self._update(receive, version, abort_all, num_paused_requests=0)

    async def _update(self, receive, version: int, abort_all: bool, **extra) -> web.Response:
        if abort_all:
            self.engine.abort(None)
        # its own task: a client that disconnects mid-update cancels only this handler, never a
        # swap half-done (tensors received but not loaded, or loaded under the old version)
        update = asyncio.ensure_future(self.engine.update_weights(receive, version))
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)
        if not await self._unless_closing(update):
            return _shutting_down("weight update")
        try:
            update.result()
        except (ValueError, RuntimeError) as exc:
            return _result(False, f"weight update failed: {type(exc).__name__}: {exc}", **extra)
        return _result(True, f"weights updated to version {self.engine.weight_version}", **extra)

    async def _unless_closing(self, work: asyncio.Future) -> bool:
        """Wait for ``work`` unless the server starts shutting down first: then cancel it (a join
        or a receive still blocked in its daemon thread is abandoned) and return ``False``. A
        cancelled caller (the client went away) does not cancel ``work``: a weight swap is never
        left half-done."""
        closing = asyncio.ensure_future(self._closing.wait())
        try:  # unlike wait_for, asyncio.wait leaves ``work`` running when this caller is cancelled
            await asyncio.wait([work, closing], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.add_done_callback(_log_unanswered)  # its outcome is read once, by the log
            raise
        finally:
            closing.cancel()
        if work.done():
            return True
        work.cancel()
        return False


def _log_unanswered(work: asyncio.Future) -> None:
    """Log how a join or weight update ended after its client went away (nobody else reads it)."""
    if not work.cancelled() and work.exception() is not None:
        _log.warning("a weight-group call whose client went away failed: %s: %s",
                     type(work.exception()).__name__, work.exception())


@contextlib.asynccontextmanager
async def serve(server: InferenceServer, host: str = "127.0.0.1", port: int = 0):
    """Serve ``server`` on ``host:port`` (0: a free port) inside the running loop; yields the base URL."""
    # handler_cancellation: a handler is cancelled when its client disconnects (aiohttp's default
    # lets it run on), so a gone client's generation stops holding a slot
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
        bound = runner.addresses[0][1]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()
