"""InferenceClient's requests and answers: SGLang request shapes and log-prob checks (a recording
server), generation across a pause or a weight update, caller aborts, errors, the server's CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
import torch
from aiohttp import web

from areal_async.devices import free_port
from areal_async.inference.client import GenResult, InferenceClient, LogprobAlignmentError, ServerError
from tests.support.fakes import SGLANG_ABORTED, SGLANG_FINISHED, fake_server
from tests.support.models import prompt_ids
from tests.support.servers import running

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
