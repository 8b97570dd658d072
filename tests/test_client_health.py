"""Health checks of an inference server, against a stand-in with SGLang's rules: a pause is not a
hang, a dead engine's /ready 503 is, in the client's routing and the launcher's probe."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from areal_async.inference.client import InferenceClient, NoServerLeft
from tests.support.fakes import SGLANG_FINISHED, fake_server


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SGLangLike:
    """A server with SGLang 0.5.23's health rules (``http_server.health_generate``, ``/ready``,
    ``tokenizer_manager.generate_request``): while paused, ``/ready`` is 503 at once and every
    generation, the health one too, waits for ``continue_generation``; ``hung``: the HTTP layer
    answers ``/ready`` 200 but no generation ever comes back (a stuck scheduler); ``ready_body``: the
    body of ``/ready``'s 503 (SGLang's is empty; the embedded server's for a dead engine, its error
    body)."""

    def __init__(self):
        self.running = asyncio.Event()
        self.running.set()
        self.hung = False
        self.ready_body = b""
        self.released = asyncio.Event()  # ends the hung handlers, so the server can close
        self.asked: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        if request.path == "/ready":
            return web.Response(status=200) if self.running.is_set() else web.Response(status=503, body=self.ready_body)
        if self.hung:
            await self.released.wait()
            return web.Response(status=500)
        await self.running.wait()
        if request.path == "/generate":
            return web.json_response(SGLANG_FINISHED)
        return web.Response(text="")


@pytest.mark.parametrize("pause_s,max_pause_s,kept", [(1.0, 30.0, True), (1.0, 0.3, False)])
def test_a_paused_server_is_not_taken_for_hung_while_a_generation_waits(pause_s, max_pause_s, kept):
    # The server is paused for 5 health-check intervals while a generation waits on it (its
    # /health_generate would block, as SGLang's does): /ready 503 keeps it in routing, and the
    # generation completes there once it continues; paused longer than max_pause_s, it leaves.
    stub = SGLangLike()

    async def main():
        async with fake_server(stub.handle) as url:
            async with InferenceClient([url], health_check_interval_s=0.2, max_pause_s=max_pause_s) as client:
                stub.running.clear()
                call = asyncio.ensure_future(client.generate([1, 2, 3], {"max_new_tokens": 4}, "r"))
                await asyncio.sleep(pause_s)
                stub.running.set()
                try:
                    out = await asyncio.wait_for(call, 10)
                except NoServerLeft as exc:
                    return None, str(exc), client.server_failures
                return out, None, client.server_failures

    out, error, failures = asyncio.run(main())
    assert stub.asked.count("/ready") >= 3
    if kept:
        assert out.output_ids == [9, 2] and failures == 0 and "/health_generate" not in stub.asked
    else:
        assert out is None and failures == 1 and "longer than inference.max_pause_s = 0.3 s" in error


def test_a_server_whose_scheduler_hangs_leaves_routing_although_it_says_ready():
    stub = SGLangLike()
    stub.hung = True

    async def main():
        async with fake_server(stub.handle) as url:
            async with InferenceClient([url], health_check_interval_s=0.2) as client:
                try:
                    with pytest.raises(NoServerLeft, match="no answer to /health_generate within 0.2 s"):
                        await asyncio.wait_for(client.generate([1, 2, 3], {"max_new_tokens": 4}, "r"), 10)
                finally:
                    stub.released.set()
                return client.server_failures

    assert asyncio.run(main()) == 1
    assert stub.asked[:3] == ["/generate", "/ready", "/health_generate"]


def test_readiness_counts_a_pause_alive_only_up_to_max_pause_s():
    from areal_async.inference.routing import Readiness

    r = Readiness(max_pause_s=10.0)
    assert r.judge(0, 200, 0.0) is False and r.judge(0, 404, 1.0) is False  # ask for a generation
    assert r.judge(0, 503, 2.0) is True and r.judge(0, 503, 12.0) is True
    assert "for 11 s, longer than inference.max_pause_s = 10 s" in r.judge(0, 503, 13.0)
    assert r.judge(1, 503, 13.0) is True  # per server
    assert r.judge(0, 200, 14.0) is False and r.judge(0, 503, 15.0) is True  # a new pause starts again
    assert r.judge(0, None, 16.0) == "no answer to /ready"


# the embedded server's /ready 503 for a dead engine (embedded/health_api.py, errors.py; the message
# as Engine.run words it, tests/test_server_health.py)
_DEAD_READY = json.dumps({"error": {"message": "inference engine failed: RuntimeError: CUDA error: an illegal "
                                              "memory access was encountered; it runs no more steps: restart "
                                              "the server"}}).encode()


def test_readiness_takes_a_503_naming_a_dead_engine_as_dead_not_paused():
    # dead at once, however long max_pause_s is; SGLang's empty 503 (paused, unhealthy or starting
    # alike), a body that is not JSON, and an error body naming something else stay a pause
    from areal_async.inference.routing import Readiness

    r = Readiness(max_pause_s=300.0)
    assert r.judge(0, 503, 0.0, _DEAD_READY) == "GET /ready 503: " + json.loads(_DEAD_READY)["error"]["message"]
    for body in (b"", b"Service Unavailable", b'{"error": {"message": "the waiting queue is full"}}',
                 b'{"error": "inference engine failed"}', b"[1]", b"\xff"):
        assert r.judge(1, 503, 0.0, body) is True, body
    assert r.judge(0, 200, 1.0, _DEAD_READY) is False  # only a 503 says anything about a pause or death
    # after the dead answer, a pause is counted from its own start: 301 s after t = 1 s is too long
    assert r.judge(0, 503, 1.0) is True and r.judge(0, 503, 301.0) is True
    assert "for 301 s, longer than inference.max_pause_s = 300 s" in r.judge(0, 503, 302.0)


async def _asked(stub: SGLangLike, path: str, times: int) -> None:
    """Return once ``stub`` was asked ``path`` ``times`` times (the requests it records are the
    events; nothing else signals them)."""
    while stub.asked.count(path) < times:
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("dead", [True, False])
def test_a_ready_503_naming_a_dead_engine_leaves_routing_at_once_an_empty_one_is_a_pause(dead):
    # a generation waits on the server while /ready answers 503, under max_pause_s = 300 s (the
    # default): with the dead engine's error body the first health check (0.2 s) takes the server
    # out, as a lost connection would; with an empty body (SGLang's pause) it stays in routing
    # through 3 checks and the generation completes there once it continues
    stub = SGLangLike()
    stub.ready_body = _DEAD_READY if dead else b""

    async def main():
        async with fake_server(stub.handle) as url:
            async with InferenceClient([url], health_check_interval_s=0.2, max_pause_s=300.0) as client:
                stub.running.clear()
                call = asyncio.ensure_future(client.generate([1, 2, 3], {"max_new_tokens": 4}, "r"))
                try:
                    if dead:
                        with pytest.raises(NoServerLeft, match="GET /ready 503: inference engine failed: RuntimeError"):
                            await asyncio.wait_for(call, 5)
                        return None, client.server_failures
                    await asyncio.wait_for(_asked(stub, "/ready", 3), 10)  # three checks found it paused
                    assert not call.done(), call  # still waiting there: in routing
                    stub.running.set()
                    return await asyncio.wait_for(call, 10), client.server_failures
                finally:
                    stub.running.set()  # ends the waiting handlers, so the server can close

    out, failures = asyncio.run(main())
    if dead:
        assert failures == 1 and stub.asked[:2] == ["/generate", "/ready"]
    else:
        assert out.output_ids == [9, 2] and failures == 0 and "/health_generate" not in stub.asked


def test_the_launchers_server_probe_fails_a_dead_engine_at_once_and_passes_a_pause():
    from launcher.servers import ServerProbe

    stub = SGLangLike()
    stub.running.clear()

    async def main():
        async with fake_server(stub.handle) as url:
            probe = ServerProbe(url, max_pause_s=300.0)
            paused = await asyncio.to_thread(probe, "/health_generate", 1.0)
            stub.ready_body = _DEAD_READY
            dead = await asyncio.to_thread(probe, "/health_generate", 1.0)
            stub.running.set()
            return paused, dead

    paused, dead = asyncio.run(main())
    assert paused is None and dead == "GET /ready 503: " + json.loads(_DEAD_READY)["error"]["message"]
    assert stub.asked == ["/ready", "/ready"]  # no generation asked of either


def test_the_launchers_server_probe_lets_a_paused_server_pass_and_fails_a_hung_one():
    import threading

    from launcher.servers import ServerProbe

    stub = SGLangLike()
    started = threading.Event()
    box: dict = {}

    def serve():
        loop = asyncio.new_event_loop()
        box["loop"] = loop

        async def run():
            async with fake_server(stub.handle) as url:
                box["url"] = url
                box["stop"] = asyncio.Event()
                started.set()
                await box["stop"].wait()
        loop.run_until_complete(run())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        probe = ServerProbe(box["url"], max_pause_s=60.0)
        assert probe("/health_generate", 1.0) is None
        box["loop"].call_soon_threadsafe(stub.running.clear)
        assert probe("/health_generate", 1.0) is None  # paused: no generation asked
        assert stub.asked.count("/health_generate") == 1
        box["loop"].call_soon_threadsafe(stub.running.set)
        stub.hung = True
        assert probe("/health_generate", 0.5) == "no answer within 0.5 s"
    finally:
        box["loop"].call_soon_threadsafe(stub.released.set)
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)
