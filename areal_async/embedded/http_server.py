"""The embedded inference server's HTTP application: SGLang's HTTP endpoints (same JSON shapes)
over one ``Engine``.

``InferenceServer`` builds the aiohttp application from its handler groups (the route table in
``app``), checks the token, and runs the engine's loop for the application's life; ``serve`` serves
it inside the running loop. The handlers: ``generate_api.py`` (``/generate``), ``openai_api.py``
(``/v1``), ``health_api.py`` (``/health*``, ``/ready``), ``control_api.py`` (server info, flush,
pause, continue, abort), ``weight_api.py`` (weight groups and updates); their error body is
``errors.py``. The subset of SGLang's API implemented, and where it differs, is docs/sglang_api.md;
the process's command line is ``server.py``, and ``loading.py`` builds the ``Engine``.

Access (``areal_async/auth.py``): with a token (``--api-key``, SGLang's flag, or the job's
``AREAL_ASYNC_TOKEN``, which ``launcher.local`` sets) every endpoint but ``/health*`` and ``/ready``
needs ``Authorization: Bearer <token>``, as SGLang's ``--api-key`` does; without one, or a wrong
one, the answer is HTTP 401 and the body is not read. Without a token the server starts only on a
loopback ``--host``. A body over ``--max-request-bytes`` (16 MiB by default, far above a batch of
long prompts or a weight bucket's names and shapes) is HTTP 413. A handler whose client disconnects
is cancelled (aiohttp's ``handler_cancellation``), which aborts a generation's requests in the
engine (a weight update runs on in its own task, ``weight_api.py``). The listen backlog is
SGLang's, 2048: a burst of that many connections waits in the kernel, none for a SYN retransmission.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from .. import auth
from .control_api import ControlApi
from .engine.engine import Engine
from .errors import error
from .generate_api import GenerateApi
from .health_api import HealthApi
from .openai_api import OpenAIApi
from .weight_api import WeightApi

MAX_REQUEST_BYTES = 16 * 1024 * 1024  # default body limit (HTTP 413 above it)
# connections the kernel completes before the server accepts them: SGLang's (uvicorn's default);
# aiohttp's 128 makes the 129th of a burst of clients wait a second for a SYN retransmission
LISTEN_BACKLOG = 2048


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
        self.generation = GenerateApi(engine, tokenizer, stream_interval)
        self.health = HealthApi(engine)
        self.control = ControlApi(engine, model_path)
        self.weights = WeightApi(engine)
        self.openai = OpenAIApi(engine, tokenizer, served_model_name or model_path, stream_interval)
        self._task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes,
                              middlewares=[self._check_token] if self.token is not None else [])
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        generation, health, control, weights, openai = (self.generation, self.health, self.control, self.weights,
                                                        self.openai)
        routes = [
            ("POST", "/generate", generation.generate),
            ("GET", "/health", health.health),
            ("GET", "/health_generate", health.health_generate),
            ("GET", "/ready", health.ready),
            ("GET", "/get_model_info", control.get_model_info),
            ("GET", "/get_server_info", control.get_server_info),
            ("GET", "/server_info", control.get_server_info),
            ("GET", "/get_weight_version", control.get_weight_version),
            ("GET", "/flush_cache", control.flush_cache),
            ("POST", "/flush_cache", control.flush_cache),
            ("POST", "/pause_generation", control.pause_generation),
            ("POST", "/continue_generation", control.continue_generation),
            ("POST", "/abort_request", control.abort_request),
            ("POST", "/init_weights_update_group", weights.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", weights.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", weights.destroy_weights_update_group),
            ("POST", "/update_weights_from_disk", weights.update_weights_from_disk),
            ("POST", "/load_lora_adapter", weights.load_lora_adapter),
            ("POST", "/unload_lora_adapter", weights.unload_lora_adapter),
            ("POST", "/update_weight_version", weights.update_weight_version),
            ("GET", "/v1/models", openai.models),
            ("GET", "/v1/models/{model:.+}", openai.model),
            ("POST", "/v1/completions", openai.completions),
            ("POST", "/v1/chat/completions", openai.chat_completions),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    @web.middleware
    async def _check_token(self, request: web.Request, handler) -> web.StreamResponse:
        # before the handler reads the body: a caller without the token changes nothing
        if request.path.startswith(auth.OPEN_PREFIXES) or auth.bearer_ok(request.headers.get(auth.HEADER), self.token):
            return await handler(request)
        return error("Unauthorized: send the job's token as 'Authorization: Bearer <token>' (AREAL_ASYNC_TOKEN)",
                     status=401)

    async def _start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self.engine.run(), name="engine")

    async def _shutdown(self, app: web.Application) -> None:
        # runs before aiohttp waits for the handlers in flight: a join waiting for peers gives up
        self.weights.begin_shutdown()

    async def _stop(self, app: web.Application) -> None:
        await self.weights.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    @property
    def engine_task(self) -> asyncio.Task | None:
        return self._task


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
