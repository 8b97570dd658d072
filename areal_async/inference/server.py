"""The embedded inference server: SGLang's HTTP endpoints (same JSON shapes) over ``Engine``.

Run: ``python -m areal_async.inference.server --model-path DIR --port 30000 [--dtype bfloat16]
[--device cpu] [--max-running-requests 32] [--max-seq-len 1024] [--threads N] [--weight-version 0]
[--enable-deterministic-inference] [--disable-radix-cache] [--prefix-cache-entries 8]
[--debug-jitter-ms MS --debug-jitter-seed S]``.

``--enable-deterministic-inference`` (as SGLang's flag) makes the forward batch-invariant: a
request's tokens and log-probs do not depend on which other requests share its decode steps.
``--disable-radix-cache`` (SGLang's flag) turns prompt reuse off: every prompt is computed in full;
``--prefix-cache-entries`` is how many prompts the prefix cache holds (one KV row each).
``meta_info.cached_tokens`` is how many prompt tokens a request copied instead of computing.
``--debug-jitter-ms`` sleeps a seeded random delay before each engine step (determinism tests).

Implemented subset (see docs/sglang_api.md): ``/generate`` (``input_ids`` or ``text``, single or batch;
no streaming, no ``stop`` strings), ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_weight_version``, ``/flush_cache`` (empties the prefix cache; 400 while requests run, as
SGLang), ``/pause_generation`` (``abort`` | ``in_place``), ``/continue_generation``,
``/abort_request``, ``/init_weights_update_group``, ``/update_weights_from_distributed`` (gloo or
NCCL broadcast from rank 0 in ``names`` order, or SGLang's ``flattened_bucket``; the group is built
as SGLang builds it, ``weight_group``), ``/update_weights_from_disk`` (an HF safetensors
directory). Bad input is HTTP 400 with ``{"error": {"message": ...}}`` (the weight endpoints answer
SGLang's ``{"success": false, "message": ...}``), naming the field; fields have exact JSON types
(``return_logprob`` is ``true``/``false``, never ``"false"``; the two weight-group endpoints read
their scalars as SGLang's schemas do, ``"29612"`` as a port: ``weight_requests``;
``text`` a string or a list of strings; a missing or null field takes SGLang's default, e.g.
``group_name`` ``"weight_update_group"``). ``rid`` is a string (one prompt) or a list of distinct
strings (a batch, one per prompt), never one an unfinished request holds; ``weight_version`` an
integer below 2**63 (SGLang sends it as a string, ``"3"``) that never goes back: a version behind
the server's is refused before any tensor is read or received (the current one is accepted: each
bucket of a distributed update carries it). A generation whose
log-probs are not all finite (broken weights) is HTTP 500 with that body, naming the rid and the
weight version, whether or not log-probs were asked for; ``/health_generate`` is then 503.

A ``/generate`` whose client disconnects is cancelled (aiohttp's ``handler_cancellation``), which
aborts its requests in the engine; weight updates run in their own task, so a disconnect never
leaves one half-applied. ``/init_weights_update_group`` joins the group in a daemon thread: on
SIGTERM the server answers a join still waiting for peers with 503 and exits without waiting for it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import pathlib
import signal
import uuid

import torch
from aiohttp import web
from safetensors.torch import load_file

from .. import weight_group
from ..config import cuda_index, port_in_use
from ..jitter import Jitter
from .engine import Completion, Engine
from . import weight_requests
from .forward import BatchedForward, check_weight_names
from .sampling import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_WEIGHT_VERSION = 2**63  # the first version refused: versions are int64 step counts
_log = logging.getLogger(__name__)


def load_engine(
    model_path: str,
    dtype: str = "bfloat16",
    device: str = "cpu",
    max_running_requests: int = 32,
    max_seq_len: int = 1024,
    max_prefill_tokens: int = 4096,
    weight_version: int = 0,
    deterministic: bool = False,
    jitter: Jitter | None = None,
    cuda_graph: bool = True,
    prefix_cache: bool = True,
    prefix_cache_entries: int = 8,
):
    """Load an HF causal-LM directory into an ``Engine``; returns ``(engine, tokenizer)``.

    ``deterministic``: batch-invariant forward (see ``forward.py``); ``jitter``: per-step delays;
    ``cuda_graph``: replay captured decode steps on CUDA (``cuda_graph.py``); ``prefix_cache``:
    reuse prompts' keys and values (``engine.py``), in ``prefix_cache_entries`` extra KV rows.

    Raises:
        ValueError: unknown dtype, ``prefix_cache_entries < 1`` with the prefix cache on, or an
            unsupported architecture.
    """
    if prefix_cache and prefix_cache_entries < 1:
        raise ValueError(f"prefix_cache_entries {prefix_cache_entries}: the prefix cache needs at least one "
                         f"entry; give prefix_cache_entries >= 1, or turn the prefix cache off")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per process clutters the job's console

    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos: set[int] = set()
    sources = [model.config.eos_token_id, tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    for ids in sources:
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    # deterministic mode reuses only a prompt repeated within a step, which needs no rows (engine.py)
    rows = prefix_cache_entries if prefix_cache and not deterministic else 0
    forward = BatchedForward(model, max_running_requests, max_seq_len, batch_invariant=deterministic,
                             cuda_graph=cuda_graph, prefix_rows=rows)
    return Engine(forward, eos, max_prefill_tokens, weight_version, jitter, prefix_cache), tokenizer


def _error_json(message: str) -> str:
    """The body of every error answer, SGLang's ``{"error": {"message": ...}}``, as JSON text."""
    return json.dumps({"error": {"message": message}})


def _error(message: str, status: int = 400) -> web.Response:
    """An error answer for a handler to return: HTTP ``status`` with the ``_error_json`` body."""
    return web.Response(text=_error_json(message), status=status, content_type="application/json")


def _bad_request(message: str) -> web.HTTPBadRequest:
    """HTTP 400 with the ``_error_json`` body, for code that raises rather than returns (``_body``)."""
    return web.HTTPBadRequest(text=_error_json(message), content_type="application/json")


def _result(success: bool, message: str, **extra) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def _shutting_down(what: str) -> web.Response:
    return web.json_response({"success": False, "message": f"{what} abandoned: the server is shutting down"},
                             status=503)


def _rids(raw, n: int, batch: bool) -> list[str]:
    """The request ids of ``n`` prompts: ``raw`` is SGLang's ``rid`` field, a string for one prompt,
    a list of ``n`` strings for a batch, or ``None`` (fresh ids).

    Raises:
        ValueError: any other shape or element type, an empty id, or one id given to two prompts.
    """
    if raw is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if not batch:
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"rid {raw!r} is not a non-empty string; send a string request id for one "
                             f"prompt (or leave rid out)")
        return [raw]
    if not isinstance(raw, list) or len(raw) != n or not all(isinstance(r, str) and r for r in raw):
        raise ValueError(f"rid {raw!r} is not a list of {n} non-empty strings; send a list of {n} string "
                         f"request ids, one per prompt (or leave rid out)")
    repeated = _first_repeated(raw)
    if repeated is not None:
        raise ValueError(f"rid {repeated!r} is given to {raw.count(repeated)} prompts of the batch; send "
                         f"a distinct request id for each prompt (or leave rid out)")
    return raw


def _first_repeated(items: list[str]) -> str | None:
    """The first item of ``items`` that appears more than once, or ``None``."""
    return next((item for item, count in collections.Counter(items).items() if count > 1), None)


def _non_finite(done: list[Completion], rids: list[str]) -> str | None:
    """The error message for completions with a non-finite log-prob (NaN or inf: the weights in
    service are broken), naming the first one's rid and weight version; ``None`` when all are
    finite. JSON has no NaN, and tokens drawn from such logits are noise."""
    bad = [(rid, c) for c, rid in zip(done, rids) if not all(map(math.isfinite, c.logprobs))]
    if not bad:
        return None
    (rid, c), more = bad[0], f" (and {len(bad) - 1} more of the batch)" if len(bad) > 1 else ""
    return (f"the model produced non-finite log-probs (NaN or inf) for rid {rid!r}{more} under weight "
            f"version {c.weight_version}: those weights are broken (e.g. a diverged training step); "
            f"load good weights, e.g. a version from before the divergence")


def _weight_version(raw, current: int) -> int:
    """SGLang's ``weight_version`` field as an int: ``None`` keeps ``current``; an int or its decimal
    string (``"3"``, the form SGLang's clients send) in ``[current, _MAX_WEIGHT_VERSION)`` is the new
    version. ``current`` itself is allowed: every bucket of a distributed update carries the
    version, which the first bucket already set.

    Raises:
        ValueError: anything else (negative, fractional, a bool, a non-numeric string), a version
            behind ``current`` or one of ``_MAX_WEIGHT_VERSION`` or more.
    """
    if raw is None:
        return current
    if type(raw) is int and raw >= 0:
        version = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit():
        version = int(raw)
    else:
        raise ValueError(f"weight_version {raw!r} is not a non-negative integer; send the policy version "
                         f'as a decimal string, e.g. "3" (or leave it out to keep version {current})')
    if version >= _MAX_WEIGHT_VERSION:
        raise ValueError(f"weight_version {raw!r} is not below 2**63 (versions are int64); send the policy "
                         f"version, the trainer's step count (this server is at version {current})")
    if version < current:
        raise ValueError(f"weight_version {raw!r} is behind this server's current version {current}; a "
                         f"weight update never goes back: send a version >= {current}")
    return version


_KINDS = {  # the JSON type a request field must have: (check, what to send)
    "bool": (lambda v: type(v) is bool, "a JSON boolean (true or false)"),
    "int": (lambda v: type(v) is int, "an integer"),
    "port": (lambda v: type(v) is int and 1 <= v <= 65535, "a port number in [1, 65535]"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
             "a list of non-empty strings"),
    "shapes": (lambda v: isinstance(v, list) and all(isinstance(s, list) and all(type(d) is int and d >= 0 for d in s)
                                                     for s in v), "a list of shapes, each a list of integers >= 0"),
    "text": (lambda v: isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, str) for t in v)),
             "a string, or a non-empty list of strings (a batch)"),
}
_REQUIRED = object()  # ``_field``'s default for a field the request must carry


def _field(body: dict, key: str, kind: str, default=_REQUIRED, send: str | None = None):
    """``body[key]``, checked to be of ``kind`` (a key of ``_KINDS``: exact JSON types, so ``true``
    is not an integer and ``"false"`` not a boolean); a missing or null field is ``default``.

    Raises:
        ValueError: the field is missing and has no default, or is of another type; the message
            names the value and what to send (``send``, else the kind's description).
    """
    value = body.get(key)
    if value is None and default is not _REQUIRED:
        return default
    check, want = _KINDS[kind]
    if key not in body:
        raise ValueError(f"{key} is missing; send {send or want}")
    if not check(value):
        raise ValueError(f"{key} {value!r} is not {want}; send {send or want}")
    return value


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except ValueError as exc:
        raise _bad_request(f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _bad_request("request body must be a JSON object")
    return data


class InferenceServer:
    """HTTP handlers around one ``Engine``; ``app()`` builds the aiohttp application."""

    def __init__(self, engine: Engine, tokenizer, model_path: str):
        self.engine, self.tokenizer, self.model_path = engine, tokenizer, model_path
        self.groups: dict = {}
        self._task: asyncio.Task | None = None
        self._closing = asyncio.Event()  # set when the application starts shutting down
        self._updates: set[asyncio.Task] = set()  # weight updates in flight (the loop holds tasks weakly)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        routes = [
            ("POST", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health_generate),
            ("GET", "/get_model_info", self.get_model_info),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/flush_cache", self.flush_cache),
            ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

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

    async def generate(self, request: web.Request) -> web.Response:
        try:
            prompts, batch, rids, params, logprob = self._parse_generate(await _body(request))
        except ValueError as exc:
            return _error(str(exc))
        # Cancelled when the client disconnects, and if one prompt fails: the task group then
        # cancels every other generate, which aborts its request (no slot is left to nobody).
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self.engine.generate(p, params, r)) for p, r in zip(prompts, rids)]
        except ExceptionGroup as failed:
            first = failed.exceptions[0]  # the first prompt's error, as a single call raises it
            if isinstance(first, ValueError):  # its rid was taken by a request queued since the check
                return _error(str(first))
            raise first from None
        done = [t.result() for t in running]
        broken = _non_finite(done, rids)
        if broken:
            return _error(broken, status=500)
        out = [self._response(c, r, params, logprob) for c, r in zip(done, rids)]
        return web.json_response(out if batch else out[0])

    def _parse_generate(self, body: dict) -> tuple[list[list[int]], bool, list[str], SamplingParams, bool]:
        """A ``/generate`` body's prompts (token ids), whether it is a batch, the rids, the sampling
        params and ``return_logprob``; raises ``ValueError`` naming the field that is wrong."""
        if _field(body, "stream", "bool", False):
            raise ValueError("stream=true is not supported by this server; send stream=false")
        logprob = _field(body, "return_logprob", "bool", False)
        ids = body.get("input_ids")
        if ids is not None and body.get("text") is not None:  # SGLang refuses both as well
            raise ValueError("send either 'input_ids' or 'text', not both")
        if ids is None and body.get("text") is not None:
            ids = self._tokenize(_field(body, "text", "text"))
        if not isinstance(ids, list):
            raise ValueError("send 'input_ids' (a list of token ids, or a list of such lists) or 'text'")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompts):
            raise ValueError("'input_ids' must be a list of integer token ids, or a list of such lists")
        if not isinstance(body.get("sampling_params", {}), (dict, type(None))):
            raise ValueError("'sampling_params' must be a JSON object, e.g. {\"max_new_tokens\": 16}")
        rids = _rids(body.get("rid"), len(prompts), batch)
        params = SamplingParams.parse(body.get("sampling_params"))
        for prompt, rid in zip(prompts, rids):
            self.engine.validate(prompt, params, rid)
        return prompts, batch, rids, params, logprob

    def _tokenize(self, text: str | list[str]) -> list[int] | list[list[int]]:
        """``text`` (one prompt, or a list for a batch) as token ids; raises ``ValueError`` for a
        prompt with no tokens (the engine would name ``input_ids``, which the caller did not send)."""
        texts = [text] if isinstance(text, str) else text
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        empty = [t for t, p in zip(texts, ids) if not p]
        if empty:
            raise ValueError(f"text {empty[0]!r} has no tokens; send at least one character of prompt")
        return ids[0] if isinstance(text, str) else ids

    def _response(self, c: Completion, rid: str, params: SamplingParams, logprob: bool) -> dict:
        finish = {"type": c.finish_reason}
        if c.finish_reason == "stop":
            finish["matched"] = c.matched
        elif c.finish_reason == "length":
            finish["length"] = len(c.output_ids)
        elif c.finish_reason == "abort":
            finish["message"] = "aborted"
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids),
            "cached_tokens": c.cached_tokens,
            "weight_version": str(c.weight_version),
        }
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
        text = self.tokenizer.decode(c.output_ids, skip_special_tokens=params.skip_special_tokens)
        return {"text": text, "output_ids": c.output_ids, "meta_info": meta}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        start = next(iter(self.engine.eos_token_ids), 0)
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        rid = f"health-{uuid.uuid4().hex}"
        broken = _non_finite([await self.engine.generate([start], params, rid)], [rid])
        if broken:  # SGLang answers 503 when its health generation fails
            return _error(broken, status=503)
        return web.Response(text="")

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

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_running:
            return web.Response(status=400, text="Cache not flushed: requests are running.")
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            await self.engine.pause(_field(await _body(request), "mode", "str", "abort"))
        except ValueError as exc:
            return _error(str(exc))
        return web.json_response({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            rid = None if _field(body, "abort_all", "bool", False) else _field(
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

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            bucket = weight_requests.parse_bucket(body)
            version = _weight_version(bucket.weight_version, self.engine.weight_version)
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
                [weight_group.dtype_from_name(d) for d in bucket.dtypes], bucket.shapes,
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
            version = _weight_version(body.get("weight_version"), self.engine.weight_version)
            abort_all = _field(body, "abort_all_requests", "bool", False)
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
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF causal-LM directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=1024)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant forward: results independent of the other requests")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: eager decode steps")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="compute every prompt in full (no reuse of cached prompts' keys and values)")
    p.add_argument("--prefix-cache-entries", type=int, default=8,
                   help="prompts the prefix cache holds, one KV row of --max-seq-len positions each")
    p.add_argument("--debug-jitter-ms", type=float, default=0.0, help="random delay before each step")
    p.add_argument("--debug-jitter-seed", type=int, default=0)
    p.add_argument("--debug-jitter-stream", type=int, default=0, help="e.g. the server index")
    args = p.parse_args(argv)
    # bad values exit here with argparse's usage line (code 2), before the model loads
    for flag, value in (("--max-running-requests", args.max_running_requests), ("--max-seq-len", args.max_seq_len),
                        ("--max-prefill-tokens", args.max_prefill_tokens),
                        ("--prefix-cache-entries", args.prefix_cache_entries)):
        if value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: must be in [0, 65535] (0 picks a free port)")
    why = port_in_use(args.host, args.port) if args.port else None
    if why:
        p.error(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({why}); "
                f"another process holds it, pick another port (0 picks a free one)")
    if not 0 <= args.weight_version < _MAX_WEIGHT_VERSION:
        p.error(f"--weight-version {args.weight_version}: must be >= 0 and < 2**63 (the policy version "
                f"being served)")
    if not (pathlib.Path(args.model_path) / "config.json").is_file():
        p.error(f"--model-path {args.model_path!r}: not an HF model directory (no config.json there)")
    try:
        cuda_index("--device", args.device, torch.cuda.is_available())
    except ValueError as exc:
        p.error(str(exc))
    return args


async def main(argv: list[str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; exits with the engine's error if the engine loop dies."""
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    jitter = Jitter(args.debug_jitter_ms, args.debug_jitter_seed, "server", args.debug_jitter_stream)
    engine, tokenizer = load_engine(args.model_path, args.dtype, args.device, args.max_running_requests,
                                    args.max_seq_len, args.max_prefill_tokens, args.weight_version,
                                    args.enable_deterministic_inference, jitter if jitter.enabled else None,
                                    cuda_graph=not args.disable_cuda_graph,
                                    prefix_cache=not args.disable_radix_cache,
                                    prefix_cache_entries=args.prefix_cache_entries)
    server = InferenceServer(engine, tokenizer, args.model_path)
    async with serve(server, args.host, args.port) as url:
        mode = "deterministic" if args.enable_deterministic_inference else "throughput"
        print(f"inference server on {url} ({args.model_path}, {args.dtype}, {args.device}, {mode})", flush=True)
        await _wait_for_stop(server)


async def _wait_for_stop(server: InferenceServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([stop_task, server.engine_task], return_when=asyncio.FIRST_COMPLETED)
    engine_error = server.engine_task.done() and not server.engine_task.cancelled() and server.engine_task.exception()
    stop_task.cancel()
    if engine_error:
        raise engine_error


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
