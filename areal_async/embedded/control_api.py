"""The server's state and flow control, as SGLang 0.5.23 answers them: ``ControlApi``.

``/get_model_info``; ``/server_info`` (and its deprecated alias ``/get_server_info``): the keys of
SGLang's ``ServerArgs`` and scheduler info that apply to this server, under SGLang's names;
``internal_states`` also carries the prefix cache's cumulative ``cache_hit_rate`` (SGLang's name;
its own is over a recent window) and the two token counts behind it; ``/get_weight_version`` (a string, as SGLang's); ``/flush_cache`` (empties the prefix cache; 400
while requests run, as SGLang); ``/pause_generation`` (``abort`` | ``in_place``; 500 once the
engine died); ``/continue_generation``; ``/abort_request`` (``{rid}`` or ``{abort_all: true}``).
Bad input is HTTP 400 with the ``errors.py`` body.
"""

from __future__ import annotations

import importlib.metadata

from aiohttp import web

from . import fields
from ..dtypes import dtype_name
from .engine.engine import Engine
from .engine.requests import EngineFailed
from .errors import error, json_body

SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP API (and request schema) this server follows


def _project_version() -> str:
    """This project's installed version (``/server_info``), or ``"unknown"`` when run from a checkout
    that is not installed."""
    try:
        return importlib.metadata.version("areal-async")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ControlApi:
    """The info and flow-control handlers over ``engine``, serving ``model_path``."""

    def __init__(self, engine: Engine, model_path: str):
        self.engine, self.model_path = engine, model_path

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
            # the prefix cache's hit rate since start: prompt tokens copied / prompt tokens admitted
            "internal_states": [{"num_running_reqs": engine.num_running,
                                 "prompt_tokens_total": engine.prompt_tokens_total,
                                 "cached_tokens_total": engine.cached_tokens_total,
                                 "cache_hit_rate": engine.cached_tokens_total / max(1, engine.prompt_tokens_total)}],
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
            await self.engine.pause(fields.field(await json_body(request), "mode", "str", "abort"))
        except EngineFailed as exc:
            return error(str(exc), status=500)
        except ValueError as exc:
            return error(str(exc))
        return web.json_response({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.continue_generation()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            rid = None if fields.field(body, "abort_all", "bool", False) else fields.field(
                body, "rid", "str", send='one request id as a string, {"rid": "..."}, or {"abort_all": true}')
        except ValueError as exc:
            return error(str(exc))
        n = self.engine.abort(rid)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)"})
