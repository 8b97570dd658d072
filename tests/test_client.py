"""InferenceClient: SGLang request shapes (against a recording server that answers with SGLang's
response shapes), interruptible generation across a pause + weight update on the real embedded
server, caller aborts, health waiting, and the server's command-line entry point."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
import torch
from aiohttp import web

from areal_async.inference.client import (GenResult, InferenceClient, LogprobAlignmentError, NoServerLeft,
                                          ServerError)
from areal_async.inference.routing import ServerPool, session_score

from tests.support.fakes import SGLANG_ABORTED, SGLANG_FINISHED, fake_server, start_fake_server
from tests.support.models import prompt_ids
from areal_async.devices import free_port
from tests.support.servers import running, server_process

GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid"}
INIT_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "backend", "group_name"}
UPDATE_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_client_sends_sglang_shapes_and_resubmits_aborted_segments():
    seen: list[tuple[str, dict]] = []
    replies = {"/generate": [SGLANG_ABORTED, SGLANG_FINISHED]}

    async def record(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        seen.append((request.path, body))
        if request.path == "/generate":
            return web.json_response(replies["/generate"].pop(0))
        if request.path == "/get_weight_version":
            return web.json_response({"weight_version": "5"})
        return web.json_response({"success": True, "message": ""})

    async def main():
        async with fake_server(record) as url:
            async with InferenceClient([url]) as client:
                sampling = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 77}
                result = await client.generate([1, 2, 3], sampling, "q-0")
                await client.init_weights_update_group(0, "10.0.0.1", 29700, 1, 2, "gloo", "weight_update_group")
                await client.update_weights_from_distributed(0, ["model.norm.weight"], ["bfloat16"], [(64,)], 5)
                await client.update_weights_from_disk(0, "/ckpt/step5", 5)
                await client.pause()
                await client.continue_generation()
                await client.destroy_weights_update_group(0, "weight_update_group_1")
                return result, await client.get_weight_version(0)

    result, version = asyncio.run(main())
    # prompt and cached tokens summed over the two segments: 3 + 5 and 0 + 5
    assert result == GenResult([7, 8, 9, 2], [-0.5, -0.25, -1.0, -0.125], [4, 4, 5, 5], "stop", 8, 5)
    assert version == 5
    (p1, first), (p2, second), (p3, init), (p4, update), (p5, disk), (p6, pause), (p7, _), (p8, destroy), (p9, _) = seen
    assert p1 == p2 == "/generate" and set(first) == set(second) == GENERATE_FIELDS
    assert first["input_ids"] == [1, 2, 3] and first["sampling_params"]["max_new_tokens"] == 10
    # the resubmission: prompt + partial output, remaining budget, same seed and rid
    assert second["input_ids"] == [1, 2, 3, 7, 8] and second["rid"] == "q-0"
    assert second["sampling_params"] == {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 77}
    assert p3 == "/init_weights_update_group" and set(init) == INIT_GROUP_FIELDS and init["rank_offset"] == 1
    assert p4 == "/update_weights_from_distributed" and set(update) == UPDATE_FIELDS
    assert update["weight_version"] == "5" and update["shapes"] == [[64]] and update["dtypes"] == ["bfloat16"]
    assert p5 == "/update_weights_from_disk" and disk == {"model_path": "/ckpt/step5", "weight_version": "5"}
    assert (p6, pause) == ("/pause_generation", {"mode": "abort"}) and p7 == "/continue_generation"
    assert (p8, destroy) == ("/destroy_weights_update_group", {"group_name": "weight_update_group_1"})
    assert p9 == "/get_weight_version"


def test_a_resubmission_owes_what_is_left_of_min_new_tokens():
    seen: list[dict] = []
    replies = [SGLANG_ABORTED, SGLANG_FINISHED]

    async def record(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(replies.pop(0))

    async def main():
        async with fake_server(record) as url:
            async with InferenceClient([url]) as client:
                await client.generate([1, 2, 3], {"max_new_tokens": 10, "min_new_tokens": 5}, "q-0")

    asyncio.run(main())
    # the aborted segment made 2 tokens: 8 may come, 3 must
    assert [s["sampling_params"] for s in seen] == [{"max_new_tokens": 10, "min_new_tokens": 5},
                                                    {"max_new_tokens": 8, "min_new_tokens": 3}]


def test_a_null_logprob_from_sglang_is_a_server_error_naming_the_weight_version():
    # SGLang writes a NaN log-prob (weights gone bad) as JSON null; float(None) used to raise a
    # bare TypeError in the rollout worker that said nothing about the weights
    broken = {**SGLANG_FINISHED, "meta_info": {**SGLANG_FINISHED["meta_info"],
                                               "output_token_logprobs": [[-1.0, 9, None], [None, 2, None]]}}

    async def reply(request: web.Request) -> web.Response:
        return web.json_response(broken)

    async def main():
        async with fake_server(reply) as url, InferenceClient([url]) as client:
            with pytest.raises(ServerError, match=r"rid 'q-0' came back with 1 log-prob\(s\) that are not "
                                                  r"finite numbers \(first: None\) under weight version 5"):
                await client.generate([1, 2, 3], {"max_new_tokens": 4}, "q-0")

    asyncio.run(main())


def _with_logprobs(reply: dict, entries: list) -> dict:
    return {**reply, "meta_info": {**reply["meta_info"], "output_token_logprobs": entries}}


@pytest.mark.parametrize("replies,position,output_id,logprob_id", [
    # one entry more than output ids (sglang#20799): used to pass and crash the trainer later
    ([_with_logprobs(SGLANG_FINISHED, [[-1.0, 9, None], [-0.125, 2, None], [-0.5, 4, None]])], 2, None, 4),
    # one fewer
    ([_with_logprobs(SGLANG_FINISHED, [[-1.0, 9, None]])], 1, 2, None),
    # as many, shifted by one token: used to train silently on misaligned log-probs
    ([_with_logprobs(SGLANG_FINISHED, [[-0.3, 3, None], [-1.0, 9, None]])], 0, 9, 3),
    # the resubmission after an abort repeats the first segment's last entry: positions count from
    # the start of the whole output (the first segment made 2 tokens)
    ([SGLANG_ABORTED, _with_logprobs(SGLANG_FINISHED, [[-0.25, 8, None], [-1.0, 9, None]])], 2, 9, 8),
    # the resubmission's entries cover the whole output so far instead of its own segment
    ([SGLANG_ABORTED, _with_logprobs(SGLANG_FINISHED, SGLANG_ABORTED["meta_info"]["output_token_logprobs"]
                                     + SGLANG_FINISHED["meta_info"]["output_token_logprobs"])], 2, 9, 7),
])
def test_logprobs_that_do_not_pair_with_output_ids_raise_naming_rid_server_position_and_ids(
        replies, position, output_id, logprob_id):
    replies = list(replies)

    async def reply(request: web.Request) -> web.Response:
        return web.json_response(replies.pop(0))

    async def main():
        async with fake_server(reply) as url, InferenceClient([url]) as client:
            with pytest.raises(LogprobAlignmentError) as info:
                await client.generate([1, 2, 3], {"max_new_tokens": 10}, "q-0")
            return url, info.value

    url, err = asyncio.run(main())
    assert (err.rid, err.position, err.output_id, err.logprob_token_id) == ("q-0", position, output_id, logprob_id)
    assert isinstance(err, ServerError) and err.url == url and str(err).startswith(url)
    assert f"rid 'q-0': output_token_logprobs do not match output_ids at output position {position}: " \
           f"output id {output_id}, log-prob entry's token id {logprob_id}" in str(err)
    assert not replies, "every reply was asked for"


def test_interrupted_generation_resumes_and_reproduces_the_uninterrupted_output(tiny_model_dir, tmp_path):
    prompt = prompt_ids(tiny_model_dir)
    sampling = {"max_new_tokens": 60, "temperature": 1.0, "sampling_seed": 21, "ignore_eos": True}
    # "new" weights = the same weights, so the continuation must reproduce the uninterrupted run
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).save_pretrained(tmp_path / "same")

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url]) as client:
                plain = await client.generate(prompt, sampling, "plain")
                task = asyncio.create_task(client.generate(prompt, sampling, "interrupted"))
                for _ in range(5):
                    await engine.next_step()
                await client.pause()
                await client.update_weights_from_disk(0, str(tmp_path / "same"), 1)
                await client.continue_generation()
                return plain, await task

    plain, interrupted = asyncio.run(main())
    assert plain.finish_reason == interrupted.finish_reason == "length"
    assert interrupted.output_ids == plain.output_ids
    assert torch.allclose(torch.tensor(interrupted.logprobs), torch.tensor(plain.logprobs), atol=1e-5)
    split = interrupted.versions.index(1)
    assert 5 <= split < 60 and interrupted.versions == [0] * split + [1] * (60 - split)


def test_an_update_without_a_pause_waits_for_the_generation_in_flight(tiny_model_dir, tmp_path):
    # rollout.interrupt_on_update=false: no /pause_generation, so the update waits (SGLang's
    # model-update lock) for the generation in flight, which ends under version 0, and holds the
    # one arriving meanwhile until version 1 is live (compare the pause test above, whose tokens
    # span versions)
    from tests.support.models import perturbed

    prompt = prompt_ids(tiny_model_dir)
    sampling = {"max_new_tokens": 60, "temperature": 1.0, "sampling_seed": 21, "ignore_eos": True}
    later_sampling = {**sampling, "max_new_tokens": 8}
    perturbed(tiny_model_dir, seed=3).save_pretrained(tmp_path / "new")

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url]) as client:
                plain = await client.generate(prompt, sampling, "plain")
                old_later = await client.generate(prompt, later_sampling, "old-later")
                task = asyncio.create_task(client.generate(prompt, sampling, "in-flight"))
                for _ in range(5):
                    await engine.next_step()
                update = asyncio.create_task(client.update_weights_from_disk(0, str(tmp_path / "new"), 1))
                while not (engine._updates_waiting or update.done()):  # the call reached the engine
                    await asyncio.sleep(0.005)
                later = asyncio.create_task(client.generate(prompt, later_sampling, "later"))
                while not (engine._held or later.done()):  # it reached the engine and was held back
                    await asyncio.sleep(0.005)
                in_flight = await task
                return plain, old_later, in_flight, await update, await later

    plain, old_later, in_flight, update, later = asyncio.run(main())
    assert update["success"], update
    assert in_flight.versions == [0] * 60 and in_flight.output_ids == plain.output_ids
    assert torch.allclose(torch.tensor(in_flight.logprobs), torch.tensor(plain.logprobs), atol=1e-5)
    assert later.versions == [1] * 8 and later.logprobs != old_later.logprobs  # the new weights


def test_caller_abort_ends_with_abort(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url]) as client:
                task = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 200, "ignore_eos": True}, "mine"))
                await engine.next_step()
                await client.abort("mine")
                return await task

    result = asyncio.run(main())
    assert result.finish_reason == "abort" and 1 <= len(result.output_ids) < 200


def test_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with InferenceClient([url], max_retries=1, backoff_s=0.01) as client:
            with pytest.raises(ConnectionError, match=url):
                await client.wait_healthy(timeout_s=0.3)
            with pytest.raises(aiohttp.ClientConnectionError):
                await client.get_model_info(0)

    asyncio.run(main())


def test_http_errors_raise_server_error_with_the_message(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir, max_seq_len=32) as (api, _):
            async with InferenceClient([api.url]) as client:
                with pytest.raises(ServerError, match="exceeds the server's max_seq_len 32"):
                    await client.generate([1] * 30, {"max_new_tokens": 8}, "long")

    asyncio.run(main())


def test_server_entry_point_serves_and_stops_on_sigterm(tiny_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "areal_async.embedded.server", "--model-path", str(tiny_model_dir),
           "--port", str(port), "--dtype", "float32", "--max-running-requests", "4", "--max-seq-len", "128",
           "--threads", "1", "--weight-version", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        async def main():
            async with InferenceClient([f"http://127.0.0.1:{port}"]) as client:
                await client.wait_healthy(timeout_s=60)
                out = await client.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0}, "cli")
                return out, await client.get_weight_version(0)

        out, version = asyncio.run(main())
        assert len(out.output_ids) <= 3 and out.versions == [3] * len(out.output_ids) and version == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
# as Engine.run words it, tests/test_server.py)
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
