"""``/health``, ``/health_generate`` and ``/ready`` (open without the token), answered as SGLang
0.5.23 answers them (``entrypoints/http_server.py``): ``HealthApi``.

``/ready``: 200, or 503 at once while generation is paused or the server is unhealthy. ``/health``:
200 (SGLang's runs a generation by default; this one does not). ``/health_generate``: a one-token
generation, never refused by the queue bound, answered 200 once it ends or, as SGLang's, once a
step of other requests commits meanwhile, so a server whose slots are all busy answers without
waiting for one; at once while generation is paused or a weight update waits (SGLang's waits).
Unlike SGLang's, it proves health only by finite log-probs: a generation or a step whose log-probs
are not all finite (broken weights) is 503, naming the weight version.

Unhealthy: an engine whose loop died (``EngineFailed``) serves nothing more, so all three answer 503
with the ``errors.py`` body naming the cause (SGLang's 503s have an empty body; a SGLang server
dies with its scheduler).
"""

from __future__ import annotations

import asyncio
import uuid

from aiohttp import web

from .engine.engine import Engine
from .engine.sampling import SamplingParams
from .errors import error
from .streaming import non_finite


class HealthApi:
    """The health handlers over ``engine`` (module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def health(self, request: web.Request) -> web.Response:
        # SGLang's 503 for an unhealthy server: a dead engine serves nothing more
        if self.engine.failure is not None:
            return error(str(self.engine.failure), status=503)
        return web.Response(text="")

    async def ready(self, request: web.Request) -> web.Response:
        # SGLang's /ready: 503 while generation is paused (pause_generation) or the server is
        # unhealthy (here: its engine died), at once
        if self.engine.failure is not None:
            return error(str(self.engine.failure), status=503)
        return web.Response(status=503 if self.engine.paused else 200, text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.failure is not None:
            return error(str(self.engine.failure), status=503)
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
            return error(str(self.engine.failure), status=503)
        if probe.done():  # its own generation; SGLang answers 503 when that fails
            broken = non_finite([probe.result()], [rid])
            return error(broken, status=503) if broken else web.Response(text="")
        step = progress.result()
        if step.finite:
            return web.Response(text="")
        return error(f"a step of the running requests committed non-finite log-probs (NaN or inf) under weight "
                     f"version {step.weight_version}: those weights are broken (e.g. a diverged training step); "
                     f"load good weights, e.g. a version from before the divergence", status=503)
