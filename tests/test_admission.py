"""Admission under load (``areal_async/embedded/engine/admission.py``): a full waiting queue answers HTTP
503 with ``Retry-After`` on every generation endpoint, a batch is admitted whole or refused whole,
requests whose clients left never fill the queue; the client asks again after ``Retry-After``
(or its backoff, for SGLang's header-less 503), within ``overload_timeout_s``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from areal_async.inference.client import InferenceClient, ServerError
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from tests.support.fakes import SGLANG_FINISHED, fake_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 6, 7]


@contextlib.asynccontextmanager
async def bounded(model_dir, max_queued: int, slots: int = 1):
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", slots, 128, max_queued_requests=max_queued)
    async with serve(InferenceServer(engine, tokenizer, str(model_dir))) as url, aiohttp.ClientSession() as http:
        yield url, http, engine


async def until(predicate, what: str) -> None:
    """Wait (bounded, 10 s) for a condition of the engine that an HTTP call changes."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def post(http, url: str, body: dict) -> tuple[int, dict, str]:
    async with http.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.text()


def test_a_full_queue_answers_503_with_retry_after_on_every_generation_endpoint(tiny_model_dir):
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    refused = {
        "/generate": generate,
        "/generate ": {**generate, "stream": True},  # streamed: refused before the stream's headers
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    }

    async def main():
        # room for 2: the free slot and one waiting place
        async with bounded(tiny_model_dir, max_queued=1) as (url, http, engine):
            await engine.pause("in_place")  # nothing is admitted to a slot: requests stay waiting
            # a batch of 3 into room for 2 is refused whole (nothing of it queued)
            batch = await post(http, url + "/generate", {**generate, "input_ids": [PROMPT] * 3})
            n_after_batch = engine.num_waiting
            first = [asyncio.create_task(post(http, url + "/generate", generate)) for _ in range(2)]
            await until(lambda: engine.num_waiting == 2, "the first two requests to wait")
            answers = {path: await post(http, url + path.strip(), body) for path, body in refused.items()}
            engine.continue_generation()
            return batch, n_after_batch, answers, await asyncio.gather(*first), await post(http, url + "/generate",
                                                                                            generate)

    batch, n_after_batch, answers, first, after = asyncio.run(main())
    assert batch[0] == 503 and "this call brings 3" in batch[2] and n_after_batch == 0
    for path, (status, headers, text) in answers.items():
        assert status == 503, (path, status, text)
        assert headers.get("Retry-After") == "1", (path, headers)
        assert "The request queue is full. 2 request(s) wait for a KV slot (1 free)" in text, text
    assert json.loads(answers["/v1/completions"][2])["error"]["code"] == 503  # OpenAI's error body
    assert [a[0] for a in first] == [200, 200] and after[0] == 200, (first, after)


def test_requests_whose_clients_left_do_not_fill_the_queue(tiny_model_dir):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}

    async def main():
        async with bounded(tiny_model_dir, max_queued=1) as (url, http, engine):
            await engine.pause("in_place")
            gone = [asyncio.create_task(post(http, url + "/generate", body)) for _ in range(2)]  # room for 2
            await until(lambda: engine.num_waiting == 2, "the first two requests to wait")
            for task in gone:
                task.cancel()  # its client disconnects: the server aborts it, it stays in the deque
            await until(lambda: engine.num_waiting == 0, "the aborts")
            second = asyncio.create_task(post(http, url + "/generate", body))
            await until(lambda: engine.num_waiting == 1 or second.done(), "the second request to wait")
            engine.continue_generation()
            return await second

    status, _, text = asyncio.run(main())
    assert status == 200, text


def test_the_client_waits_out_refusals_so_every_request_of_a_flood_completes(tiny_model_dir):
    # room for 2 (1 slot, 1 waiting place) for 4 requests at once: two are refused (503) at first, and
    # the client asks again after Retry-After until they are in: the rollout worker sees no error
    async def main():
        async with bounded(tiny_model_dir, max_queued=1) as (url, _, engine):
            async with InferenceClient([url]) as client:
                outs = await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True},
                                                              f"r{i}") for i in range(4)))
                return outs, client.refusals

    outs, refusals = asyncio.run(main())
    assert [len(o.output_ids) for o in outs] == [3] * 4 and refusals >= 2


def test_a_burst_of_connections_is_held_by_the_kernel_until_the_server_accepts_them(tiny_model_dir):
    # 600 connections while the event loop cannot accept (this coroutine blocks it): the kernel
    # completes them up to the listen backlog only (aiohttp's default 128; SGLang's 2048), and a
    # connect beyond it waits for a SYN retransmission (1 s) instead of being queued
    async def main():
        async with bounded(tiny_model_dir, max_queued=1) as (url, _, _):
            port = int(url.rsplit(":", 1)[1])
            opened = []
            try:
                for _ in range(600):
                    opened.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except OSError:  # TimeoutError: the accept queue was full
                pass
            finally:
                for sock in opened:
                    sock.close()
            return len(opened)

    assert asyncio.run(main()) == 600


def _refusing(refusals: int, headers: dict, paths: list[str]):
    """A fake server answering 503 (with ``headers``) ``refusals`` times, then SGLang's finished
    reply; records each path it is asked."""
    async def handler(request: web.Request) -> web.Response:
        paths.append(request.path)
        if len(paths) <= refusals:
            return web.json_response({"object": "error", "message": "The request queue is full.", "code": 503},
                                     status=503, headers=headers)
        return web.json_response(SGLANG_FINISHED)
    return handler


def test_the_client_asks_again_after_the_retry_after_delay():
    paths: list[str] = []

    async def main():
        async with fake_server(_refusing(2, {"Retry-After": "0.1"}, paths)) as url:
            async with InferenceClient([url], backoff_s=5.0) as client:  # the header, not the backoff, decides
                t0 = time.monotonic()
                out = await client.generate([1, 2, 3], {"max_new_tokens": 2}, "q-0")
                return out, time.monotonic() - t0, client.refusals

    out, elapsed, refusals = asyncio.run(main())
    assert out.output_ids == [9, 2] and paths == ["/generate"] * 3 and refusals == 2
    assert 0.2 <= elapsed < 2.0, elapsed  # two waits of 0.1-0.125 s


def test_sglangs_503_without_retry_after_is_retried_on_generate_only():
    generate_paths: list[str] = []
    other_paths: list[str] = []

    async def main():
        async with fake_server(_refusing(1, {}, generate_paths)) as url:
            async with InferenceClient([url], backoff_s=0.01) as client:
                out = await client.generate([1, 2, 3], {"max_new_tokens": 2}, "q-0")
        # a 503 that names no delay on another path (the server shutting down) is no full queue
        async with fake_server(_refusing(10, {}, other_paths)) as url:
            async with InferenceClient([url], backoff_s=0.01) as client:
                with pytest.raises(ServerError) as info:
                    await client.init_weights_update_group(0, "127.0.0.1", 1, 1, 2)
        return out, info.value

    out, error = asyncio.run(main())
    assert out.output_ids == [9, 2] and generate_paths == ["/generate"] * 2
    assert error.status == 503 and other_paths == ["/init_weights_update_group"]


def test_a_server_that_stays_full_fails_the_call_after_overload_timeout():
    paths: list[str] = []

    async def main():
        async with fake_server(_refusing(10**6, {"Retry-After": "0.05"}, paths)) as url:
            async with InferenceClient([url], overload_timeout_s=0.3) as client:
                t0 = time.monotonic()
                with pytest.raises(ServerError) as info:
                    await client.generate([1, 2, 3], {"max_new_tokens": 2}, "q-0")
                return info.value, time.monotonic() - t0

    error, elapsed = asyncio.run(main())
    assert error.status == 503 and "overload_timeout_s 0.3" in str(error) and len(paths) >= 3
    assert elapsed < 0.3 + 0.1, elapsed  # gives up before a wait would pass the limit
