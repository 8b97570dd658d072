"""InferenceClient's failover and routing: a killed, down, restarted or hung server's work moves
to another, and a session's calls stay on one server (rendezvous hashing)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
import torch
from aiohttp import web

from areal_async.devices import free_port
from areal_async.inference.client import InferenceClient, NoServerLeft
from areal_async.inference.routing import ServerPool, session_score
from tests.support.fakes import SGLANG_FINISHED, fake_server, start_fake_server
from tests.support.models import prompt_ids
from tests.support.servers import server_process


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingClient(InferenceClient):
    """Records ``(server, len(input_ids))`` of every ``/generate`` call it makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generate_calls: list[tuple[int, list[int]]] = []

    async def _call(self, server, method, path, payload=None, failover=False):
        if path == "/generate":
            self.generate_calls.append((server, list(payload["input_ids"])))
        return await super()._call(server, method, path, payload, failover)


async def _tokens_streamed(url: str, prompt: list[int], n: int) -> None:
    """Stream a generation from ``url`` until it has made ``n`` tokens (its chunks are cumulative)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "stream": True,
            "rid": "clock"}
    async with aiohttp.ClientSession() as http, http.post(url + "/generate", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and len(json.loads(line[6:])["output_ids"]) >= n:
                return
    raise AssertionError(f"the stream of {url} ended before {n} tokens")


def test_a_generation_whose_server_is_killed_finishes_on_the_other_token_for_token(tiny_model_dir):
    # Server 0 (a process) steps slowly (a random delay of up to 30 ms before each step); server 1
    # runs in this process, as deterministic. Server 0's request is
    # paused once (it returns a partial output, resubmitted to server 0 with prompt + partial), then
    # server 0 is SIGKILLed: the client resubmits prompt + the partial output to server 1 with the
    # same rid and seed, and the output equals an undisturbed generation's token for token (the
    # noise is a function of seed and absolute position).
    prompt = prompt_ids(tiny_model_dir)
    sampling = {"max_new_tokens": 32, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}

    async def main(url0, proc0):
        from areal_async.embedded.http_server import InferenceServer, serve
        from areal_async.embedded.loading import load_engine

        engine, tokenizer = load_engine(str(tiny_model_dir), "float32", "cpu", 4, 256, deterministic=True)
        async with serve(InferenceServer(engine, tokenizer, str(tiny_model_dir))) as url1, \
                RecordingClient([url0, url1], backoff_s=0.05, probe_timeout_s=2.0) as client:
            await client.wait_healthy(timeout_s=120)
            plain = await client.generate(prompt, sampling, "plain", server=1)
            task = asyncio.create_task(client.generate(prompt, sampling, "moved", server=0))
            while (await client._call(0, "GET", "/get_server_info"))["internal_states"][0]["num_running_reqs"] == 0:
                assert not task.done()
                await asyncio.sleep(0.01)
            await _tokens_streamed(url0, prompt, 3)  # a request admitted after it: "moved" has tokens too
            await client._call(0, "POST", "/pause_generation", {"mode": "abort"})  # held once resubmitted
            while len(client.generate_calls) < 3:  # plain's, and the resubmission after the abort
                await asyncio.sleep(0.01)
            proc0.kill()
            return plain, await task, client

    with server_process(tiny_model_dir, "--debug-jitter-ms", "30") as (url0, proc0):
        plain, moved, client = asyncio.run(main(url0, proc0))
    assert moved.finish_reason == plain.finish_reason == "length"
    assert moved.output_ids == plain.output_ids
    # the first tokens after a resubmission are scored by its prefill, not a decode step: rounding apart
    assert torch.allclose(torch.tensor(moved.logprobs), torch.tensor(plain.logprobs), atol=1e-5)
    assert moved.versions == [0] * 32
    assert client.server_failures == 1 and client.servers.live() == [1]
    (s1, first), (s2, again), (s3, last) = client.generate_calls[1:]
    assert (s1, s2, s3) == (0, 0, 1) and first == prompt
    assert again == last and last[:len(prompt)] == prompt and len(prompt) < len(last), "no partial output"
    assert last[len(prompt):] == plain.output_ids[:len(last) - len(prompt)]


def test_no_server_left_is_a_clear_error():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        async with InferenceClient(urls, backoff_s=0.01, probe_timeout_s=0.5) as client:
            with pytest.raises(NoServerLeft, match=r"no inference server left: all 2 were taken out of routing "
                                                   r"\(http://127.0.0.1:\d+: /generate: ClientConnectorError"):
                await client.generate([1, 2], {"max_new_tokens": 2}, "r")
            return client.server_failures

    assert asyncio.run(main()) == 2


def test_with_every_server_out_the_calls_wait_for_one_to_rejoin():
    # The only server is down (the launcher restarts it): a generation and a call to every server
    # wait, the departed server asked again every 0.05 s, and go to it once it answers; a server
    # that never comes back ends the wait after rejoin_timeout_s with NoServerLeft saying so.
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def reply(request: web.Request) -> web.Response:
        if request.path == "/get_weight_version":
            return web.json_response({"weight_version": "5"})
        if request.path == "/generate":
            return web.json_response(SGLANG_FINISHED)
        return web.Response(text="")

    async def main():
        async with InferenceClient([url], backoff_s=0.01, probe_timeout_s=0.5, reprobe_interval_s=0.05,
                                   rejoin_timeout_s=60) as client:
            calls = [asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 4}, "r")),
                     asyncio.create_task(client.weight_versions())]
            while client.servers.live():  # the generation finds it dead (connection refused)
                await asyncio.sleep(0.01)
            for _ in range(3):  # several probes find it still down: the calls keep waiting
                probes = client.servers._last_probe
                while client.servers._last_probe == probes:
                    assert not any(call.done() for call in calls), [c.exception() for c in calls if c.done()]
                    await asyncio.sleep(0.01)
            runner = await start_fake_server(reply, port)
            try:
                out, versions = await asyncio.wait_for(asyncio.gather(*calls), 20)
            finally:
                await runner.cleanup()
            seen = (client.server_failures, client.servers.live())
        async with InferenceClient([url], backoff_s=0.01, probe_timeout_s=0.5, reprobe_interval_s=0.05,
                                   rejoin_timeout_s=0.3) as gone:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(NoServerLeft, match=r"all 1 were taken out of routing \(http://127.0.0.1:\d+: "
                                                   r"/generate: .*\); none rejoined within "
                                                   r"inference.server_rejoin_timeout_s=0.3 s"):
                await gone.generate([1, 2], {"max_new_tokens": 2}, "r")
            waited = asyncio.get_running_loop().time() - t0
        return out, versions, seen, waited

    out, versions, seen, waited = asyncio.run(asyncio.wait_for(main(), 60))
    assert out.output_ids == [9, 2] and out.versions == [5, 5] and versions == {0: 5}
    assert seen == (1, [0])
    assert waited >= 0.3


def test_a_server_restarted_between_calls_is_found_by_its_version_going_back():
    # Server 0 answered under version 5, then (restarted with the initial weights) under version 0:
    # that segment is dropped and generated again on server 1; a new client keeps server 0 out.
    def reply_of(versions: list[str], calls: list[str]):
        async def reply(request: web.Request) -> web.Response:
            if request.path == "/get_weight_version":
                return web.json_response({"weight_version": versions[0]})
            if request.path != "/generate":
                return web.Response(text="")
            calls.append((await request.json())["rid"])
            meta = {**SGLANG_FINISHED["meta_info"], "weight_version": versions.pop(0) if len(versions) > 1 else versions[0]}
            return web.json_response({**SGLANG_FINISHED, "meta_info": meta})
        return reply

    calls0, calls1 = [], []

    async def main():
        async with fake_server(reply_of(["5", "0"], calls0)) as url0, fake_server(reply_of(["5"], calls1)) as url1:
            async with InferenceClient([url0, url1]) as client:
                first = await client.generate([1, 2, 3], {"max_new_tokens": 4}, "a", server=0)
                again = await client.generate([1, 2, 3], {"max_new_tokens": 4}, "b", server=0)
                seen = (client.server_failures, client.servers.live())
            async with InferenceClient([url0, url1]) as fresh:
                await fresh.wait_healthy(timeout_s=5)
                return first, again, seen, (fresh.server_failures, fresh.servers.live())

    first, again, seen, fresh = asyncio.run(main())
    assert first.versions == [5, 5] and again.versions == [5, 5] and again.output_ids == [9, 2]
    assert calls0 == ["a", "b"] and calls1 == ["b"]
    assert seen == (1, [1]) and fresh == (0, [1])


def test_a_generation_on_a_hung_server_moves_on_after_a_failed_health_check():
    # Server 0 accepts connections and never answers (/generate nor /health_generate): while the
    # generation waits, its health check times out, server 0 leaves routing and the generation is
    # resubmitted to server 1, same rid.
    never = asyncio.Event()
    asked: list[tuple[int, str]] = []

    def server(i: int):
        async def reply(request: web.Request) -> web.Response:
            asked.append((i, request.path))
            if i == 0:
                await never.wait()
            if request.path == "/generate":
                assert (await request.json())["rid"] == "r"
                return web.json_response(SGLANG_FINISHED)
            return web.Response(text="")
        return reply

    async def main():
        async with fake_server(server(0)) as url0, fake_server(server(1)) as url1:
            try:
                async with InferenceClient([url0, url1], health_check_interval_s=0.2) as client:
                    out = await asyncio.wait_for(client.generate([1, 2, 3], {"max_new_tokens": 4}, "r", server=0), 10)
                    return out, client.server_failures, client.servers.live()
            finally:
                never.set()

    out, failures, live = asyncio.run(main())
    assert out.output_ids == [9, 2] and out.versions == [5, 5]
    assert (failures, live) == (1, [1])
    assert asked[:2] == [(0, "/generate"), (0, "/ready")] and (1, "/generate") in asked


# ---- session-sticky routing ----------------------------------------------------------------------


def test_a_sessions_server_is_a_function_of_its_key_and_the_live_set():
    # rendezvous hashing over 3 servers: each key has one server; a departure moves only the keys
    # of the server that left, each to the live server with its next-highest score; a rejoin moves
    # them back; a second pool (another process, another run) maps every key alike
    pool = ServerPool(["a", "b", "c"], http=lambda: None, reprobe_interval_s=1e9)
    pool._last_probe = float("inf")  # no background probe (no loop here)
    keys = [f"g{g}-s{i}" for g in range(20) for i in range(4)]
    home = {k: pool.route_session(k) for k in keys}
    assert home == {k: ServerPool(["x", "y", "z"], http=lambda: None).route_session(k) for k in keys}
    assert {k: pool.route_session(k) for k in keys} == home  # stable while the live set is
    assert sorted(set(home.values())) == [0, 1, 2]  # every server gets sessions
    assert home["g0-s0"] == max(range(3), key=lambda i: session_score("g0-s0", i))
    pool.take_out(1, "test")
    moved = {k: pool.route_session(k) for k in keys}
    for k in keys:
        if home[k] != 1:
            assert moved[k] == home[k], k  # untouched by server 1's departure
        else:
            assert moved[k] == max((0, 2), key=lambda i: session_score(k, i)), k
    assert pool.route(1) == 2  # calls without a key: as before, the next live index
    pool._down.pop(1)  # rejoined
    assert {k: pool.route_session(k) for k in keys} == home


def test_a_sessions_calls_stay_on_one_server_and_move_when_it_dies():
    calls: list[tuple[int, str]] = []  # (server, rid) of each /generate

    def reply_of(server: int):
        async def reply(request: web.Request) -> web.Response:
            if request.path == "/generate":
                calls.append((server, (await request.json())["rid"]))
                return web.json_response(SGLANG_FINISHED)
            return web.Response(text="")  # /ready and the rest: alive
        return reply

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            runners, urls = [], []
            for s in range(3):
                app = web.Application()
                app.router.add_route("*", "/{tail:.*}", reply_of(s))
                runner = web.AppRunner(app)
                await runner.setup()
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                runners.append(runner)
                urls.append(f"http://127.0.0.1:{port}")
            client = await stack.enter_async_context(
                InferenceClient(urls, backoff_s=0.01, probe_timeout_s=0.5, reprobe_interval_s=1e9))
            home = client.servers.route_session("episode-7")
            for t in range(4):  # 4, not a multiple of 3: a round-robin advanced by them would show
                await client.generate([1, 2, 3], {"max_new_tokens": 4}, f"t{t}", session="episode-7")
            for j in range(4):  # without a key: round-robin, as if no session call had been made
                await client.generate([1, 2, 3], {"max_new_tokens": 4}, f"k{j}")
            await runners[home].cleanup()  # the session's server dies
            out = await client.generate([1, 2, 3], {"max_new_tokens": 4}, "t4", session="episode-7")
            for runner in runners:
                await runner.cleanup()
            with pytest.raises(ValueError, match="give one of them"):
                await client.generate([1], {}, "x", server=0, session="e")
            return home, out, client.servers.live()

    home, out, live = asyncio.run(asyncio.wait_for(main(), 60))
    assert out.output_ids == [9, 2]
    assert calls[:4] == [(home, f"t{t}") for t in range(4)]
    assert calls[4:8] == [(0, "k0"), (1, "k1"), (2, "k2"), (0, "k3")]
    others = [i for i in range(3) if i != home]
    assert calls[8:] == [(max(others, key=lambda i: session_score("episode-7", i)), "t4")]
    assert live == others
