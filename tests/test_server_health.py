"""The embedded server's flow control and health over real HTTP: pause, abort, continue, health
probes, non-finite log-probs, a dead engine, and a client that disconnects mid-generation."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.inference.routing import engine_failure
from tests.support.models import prompt_ids
from tests.support.servers import running


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(max_new_tokens=200, temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            tasks = [asyncio.create_task(api.generate(prompt, sampling_seed=i, **kw)) for i in range(2)]
            for _ in range(3):
                await engine.next_step()
            assert (await api.get("/ready"))[0] == 200
            status, _ = await api.post("/pause_generation", {"mode": "abort"})
            assert status == 200
            assert (await api.get("/ready"))[0] == 503  # SGLang's: paused
            aborted = await asyncio.gather(*tasks)
            held = asyncio.create_task(api.generate(prompt, sampling_seed=9, max_new_tokens=5))
            while not engine._waiting:  # the held request reached the engine's queue
                await asyncio.sleep(0.005)
            assert not held.done() and engine.num_running == 0
            status, _ = await api.post("/continue_generation", {})
            assert status == 200
            assert (await api.get("/ready"))[0] == 200
            return aborted, await held

    aborted, held = asyncio.run(main())
    for resp in aborted:
        assert resp["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= len(resp["output_ids"]) < 200
        assert len(resp["meta_info"]["output_token_logprobs"]) == len(resp["output_ids"])
    assert held["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_abort_request_by_rid_and_all(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            a = asyncio.create_task(api.generate(prompt, "a", max_new_tokens=200, sampling_seed=1, **kw))
            b = asyncio.create_task(api.generate(prompt, "b", max_new_tokens=30, sampling_seed=2, **kw))
            await engine.next_step()
            status, out = await api.post("/abort_request", {"rid": "a"})
            assert status == 200
            first = await asyncio.gather(a, b)
            c = asyncio.create_task(api.generate(prompt, "c", max_new_tokens=200, sampling_seed=3, **kw))
            await engine.next_step()
            await api.post("/abort_request", {"abort_all": True})
            bad = await api.post("/abort_request", {})
            return first, await c, bad

    (a, b), c, bad = asyncio.run(main())
    assert a["meta_info"]["finish_reason"]["type"] == "abort" and 1 <= len(a["output_ids"]) < 200
    assert b["meta_info"]["finish_reason"]["type"] == "length" and len(b["output_ids"]) == 30
    assert c["meta_info"]["finish_reason"]["type"] == "abort"
    assert bad[0] == 400


def test_health_and_flush(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir) as (api, _):
            return [await api.get("/health"), await api.get("/health_generate"),
                    await api.post("/flush_cache"), await api.get("/get_model_info")]

    health, health_gen, flush, info = asyncio.run(main())
    assert health[0] == health_gen[0] == flush[0] == 200
    assert info[1]["model_path"] == str(tiny_model_dir)


def test_a_disconnected_client_frees_its_slot(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    max_new_tokens = 1500

    async def main():
        async with running(tiny_model_dir, max_seq_len=2048) as (api, engine):
            async with aiohttp.ClientSession() as gone:
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
                request = asyncio.create_task(gone.post(api.url + "/generate", json=body))
                await asyncio.wait_for(engine.next_step(), 60)  # the engine's first step: its prefill
                assert engine.num_running == 1  # admitted: it holds a slot
                request.cancel()  # drops the connection
            steps = 0
            while engine.num_running and steps < 200:
                await engine.next_step()
                steps += 1
            # the server still serves
            return steps, await api.generate(prompt, max_new_tokens=2)

    steps, after = asyncio.run(main())
    # aborted within a few steps of the disconnect (the connection loss reaches the handler at once),
    # not after the 1500 tokens it asked for
    assert steps < 50, f"the request ran {steps} more steps after its client went away"
    assert len(after["output_ids"]) <= 2


def test_health_generate_answers_while_every_slot_is_busy(tiny_model_dir):
    # One slot, held by a long generation: the health probe's own request waits for the slot, but a
    # committed step of the long one proves the server alive (SGLang's rule), so the launcher's
    # health check does not take a busy server for a hung one.
    async def main():
        async with running(tiny_model_dir, slots=1) as (api, engine):
            long = asyncio.create_task(api.generate(prompt_ids(tiny_model_dir), max_new_tokens=200, ignore_eos=True))
            await engine.next_step()
            health = await api.get("/health_generate")
            busy = not long.done()
            await long
            return health, busy, engine.num_running

    health, busy, running_after = asyncio.run(main())
    assert health == (200, "") and busy and running_after == 0


def test_health_generate_answers_at_once_while_paused_for_an_update(tiny_model_dir):
    # a paused server makes no step until the update is in; it is alive, and must not be taken for
    # a hung one by the launcher's health check
    async def main():
        async with running(tiny_model_dir) as (api, engine):
            await api.post("/pause_generation", {"mode": "abort"})
            paused = await asyncio.wait_for(api.get("/health_generate"), 5)
            await api.post("/continue_generation", {})
            return paused, await api.get("/health_generate")

    assert asyncio.run(main()) == ((200, ""), (200, ""))


def nan_weights(model_dir, out_dir):
    """The tiny model with a NaN final norm, saved to ``out_dir``: every logit, so every
    log-prob, is NaN (broken weights, e.g. a diverged training step)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(out_dir)
    return out_dir


def test_health_generate_is_503_when_the_busy_step_commits_non_finite_log_probs(tiny_model_dir, tmp_path):
    # One slot, held by a long generation under broken weights: its committed steps prove the loop
    # alive but the weights broken (that request ends in a 500), so the probe answers 503 naming
    # the version, not 200 as for a step whose log-probs are finite
    nan_dir = nan_weights(tiny_model_dir, tmp_path / "nan")

    async def main():
        async with running(tiny_model_dir, slots=1) as (api, engine):
            loaded = await api.post("/update_weights_from_disk", {"model_path": str(nan_dir), "weight_version": "3"})
            body = {"input_ids": prompt_ids(tiny_model_dir), "sampling_params": {"max_new_tokens": 200,
                                                                                 "ignore_eos": True}}
            long = asyncio.create_task(api.post("/generate", body))
            await engine.next_step()
            health = await api.get("/health_generate")
            busy = not long.done()
            return loaded, health, busy, await long

    loaded, (status, out), busy, (long_status, _) = asyncio.run(main())
    assert loaded[0] == 200 and busy and long_status == 500
    assert status == 503 and "non-finite log-probs" in out["error"]["message"], out
    assert "under weight version 3" in out["error"]["message"], out


def test_non_finite_logprobs_are_a_json_500_naming_the_weight_version(tiny_model_dir, tmp_path):
    # weights with a NaN norm make every logit NaN: JSON has no NaN (the old answer was a 200 with
    # bare NaN in it), and the rollout worker must fail on them rather than train on noise
    from areal_async.inference.client import InferenceClient, ServerError

    nan_weights(tiny_model_dir, tmp_path / "nan")

    def no_constants(name):
        raise ValueError(f"{name} in a JSON answer")

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            loaded = await api.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nan"),
                                                                  "weight_version": "3"})
            answers = []
            for ids, rid, logprob in (([1, 2], "one", True), ([[1, 2], [3]], ["p", "q"], True), ([1, 2], "bare", False)):
                body = {"input_ids": ids, "rid": rid, "return_logprob": logprob, "sampling_params": {"max_new_tokens": 3}}
                async with api.http.post(api.url + "/generate", json=body) as resp:
                    answers.append((resp.status, resp.content_type, json.loads(await resp.text(),
                                                                               parse_constant=no_constants)))
            async with InferenceClient([api.url]) as client:
                with pytest.raises(ServerError, match="HTTP 500: .*non-finite log-probs .* under weight version 3"):
                    await client.generate([1, 2], {"max_new_tokens": 3}, "worker-sample")
            health = [await health_generate(api)]
            fixed = await api.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                 "weight_version": "4"})
            health.append(await health_generate(api))
            return loaded, answers, fixed, health, await api.generate([1, 2], max_new_tokens=3, ignore_eos=True)

    async def health_generate(api):
        async with api.http.get(api.url + "/health_generate") as resp:
            return resp.status, await resp.text()

    loaded, answers, fixed, health, after = asyncio.run(main())
    assert loaded[0] == 200 and fixed[0] == 200
    assert health[0][0] == 503 and "under weight version 3" in health[0][1], health  # as SGLang's failed check
    assert health[1] == (200, ""), health
    for (status, content_type, body), rid, more in zip(answers, ["one", "p", "bare"], ["", " (and 1 more", ""]):
        assert (status, content_type) == (500, "application/json"), body
        message = body["error"]["message"]
        assert f"non-finite log-probs (NaN or inf) for rid {rid!r}{more}" in message, message
        assert "under weight version 3" in message, message
    assert after["meta_info"]["weight_version"] == "4" and len(after["output_ids"]) == 3


def _fail_next_prefill(engine) -> None:
    """Make the engine's next prefill raise, as a device fault would: its loop dies (``Engine.run``)."""
    def fault(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.forward.prefill = fault


_DEAD = "inference engine failed: RuntimeError: CUDA error: an illegal memory access was encountered"


def test_a_dead_engine_fails_health_and_ready_at_once(tiny_model_dir):
    # SGLang answers /ready and /health* 503 for an unhealthy server: a server whose engine loop
    # died serves nothing more, and its health answers must say so (with the error body), even
    # after a /continue_generation, which restarts nothing (nor may it queue requests for it)
    paths = ("/health", "/ready", "/health_generate")

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            before = [await api.get(p) for p in paths]
            _fail_next_prefill(engine)
            killing = await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            after = [await api.get(p) for p in paths]
            continued = await api.post("/continue_generation", {})
            # before: queued into the dead engine, never answered (the guard only bounds the failure)
            late = await asyncio.wait_for(api.post("/generate", {"input_ids": [1, 2]}), 60)
            return before, killing, after, continued, await api.get("/ready"), late

    before, killing, after, continued, ready, late = asyncio.run(main())
    assert before == [(200, "")] * 3
    assert killing == (500, {"error": {"message": killing[1]["error"]["message"]}}), killing
    assert _DEAD in killing[1]["error"]["message"]
    for path, (status, out) in zip(paths, after):
        assert status == 503 and _DEAD in out["error"]["message"], (path, status, out)
    assert continued[0] == 200 and ready[0] == 503 and _DEAD in ready[1]["error"]["message"], ready
    # the clients and the launcher read that /ready answer as a dead engine, not a pause
    assert engine_failure(json.dumps(ready[1]).encode()) == ready[1]["error"]["message"], ready
    assert late[0] == 500 and _DEAD in late[1]["error"]["message"], late


def test_requests_to_a_dead_engine_get_json_error_answers(tiny_model_dir):
    # the stream the engine dies under ends with SGLang's error event, then [DONE]; later calls
    # get HTTP 500 with the path's JSON error body (SGLang's, or OpenAI's under /v1), never
    # aiohttp's plain-text 500
    stream = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "stream": True}

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            _fail_next_prefill(engine)
            async with api.http.post(api.url + "/generate", json=stream) as resp:
                streamed = resp.status, await resp.read()
            answers = [
                await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
                await api.post("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0}),
                await api.post("/generate", stream),
                await api.post("/pause_generation", {"mode": "abort"}),
            ]
            completion = await api.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
            return streamed, answers, completion

    (status, raw), answers, completion = asyncio.run(main())
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""], raw
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "server_error" and _DEAD in error["message"], error
    for status, out in answers:
        assert status == 500 and isinstance(out, dict) and _DEAD in out["error"]["message"], (status, out)
    status, out = completion
    assert status == 500 and out["error"]["type"] == "server_error" and out["error"]["code"] == 500, out
    assert _DEAD in out["error"]["message"], out
