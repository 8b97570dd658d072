"""The embedded server's /generate over real HTTP (outputs, log-probs, seeds, batching, rids) and
what it refuses: malformed request bodies of every endpoint, bad command-line arguments."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.models import prompt_ids, recompute_logprobs
from tests.support.servers import BUCKET, JOIN, running, server_logprobs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_shapes_and_logprobs_match_trainer_recompute(arch, tiny_model_dir, tiny_qwen3_dir):
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen3_dir
    prompt = prompt_ids(model_dir)

    async def main():
        async with running(model_dir) as (api, _):
            full = await api.generate(prompt, "r1", max_new_tokens=24, temperature=0.8, sampling_seed=3, ignore_eos=True)
            # stop at the first occurrence of the 4th token: same seed ⇒ same prefix, then "stop"
            # (without ignore_eos, which turns stop_token_ids off as well on SGLang)
            stop_at = full["output_ids"].index(full["output_ids"][3])
            stopped = await api.generate(prompt, max_new_tokens=24, temperature=0.8, sampling_seed=3,
                                         stop_token_ids=[full["output_ids"][3]])
            return full, stop_at, stopped

    full, stop_at, stopped = asyncio.run(main())
    meta = full["meta_info"]
    assert set(full) == {"text", "output_ids", "meta_info"} and isinstance(full["text"], str)
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24 == len(full["output_ids"])
    assert meta["weight_version"] == "0" and meta["cached_tokens"] == 0
    assert [e[1] for e in meta["output_token_logprobs"]] == full["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = recompute_logprobs(model, prompt, full["output_ids"], 0.8)
    assert torch.allclose(server_logprobs(full), expected, atol=1e-5, rtol=0), (server_logprobs(full) - expected).abs().max()
    assert stopped["output_ids"] == full["output_ids"][: stop_at + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": full["output_ids"][3]}


def test_seeds_reproduce_and_differ(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, _):
            kw = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
            a = await api.generate(prompt, sampling_seed=11, **kw)
            b = await api.generate(prompt, sampling_seed=11, **kw)
            c = await api.generate(prompt, sampling_seed=12, **kw)
            return a["output_ids"], b["output_ids"], c["output_ids"]

    a, b, c = asyncio.run(main())
    assert a == b
    assert a != c


def test_request_alone_equals_request_batched_with_others(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    others = [prompt_ids(tiny_model_dir, f"Question number {i} about {'eggs ' * i}?") for i in range(1, 6)]
    kw = dict(temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            alone = await api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw)
            together = await asyncio.gather(
                api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw),
                *(api.generate(p, max_new_tokens=4 + 3 * i, sampling_seed=i, **kw) for i, p in enumerate(others)),
            )
            # join mid-flight: others are decoding (and finishing, so slots get compacted) when it arrives
            early = [asyncio.create_task(api.generate(p, max_new_tokens=2 + 2 * i, sampling_seed=i, **kw))
                     for i, p in enumerate(others)]
            await engine.next_step()
            late = await api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw)
            await asyncio.gather(*early)
            return alone, together[0], late

    alone, together, late = asyncio.run(main())
    assert together["output_ids"] == alone["output_ids"]
    assert late["output_ids"] == alone["output_ids"]
    assert torch.allclose(server_logprobs(together), server_logprobs(alone), atol=1e-5)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [], "sampling_params": {"max_new_tokens": 4}}, "input_ids is empty"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens -1 is negative"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens '8' has the wrong JSON type"),
        ({"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 5}}, "exceeds the server's max_seq_len 64"),
        ({"input_ids": [1, 10**6], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "unknown sampling_params field 'temprature'"),
        ({"sampling_params": {}}, "send 'input_ids'"),
        ({"input_ids": [[1, 2], 3]}, "list of integer token ids"),
        ({"input_ids": [1, True]}, "list of integer token ids"),
        ({"input_ids": [1, 2], "sampling_params": [1]}, "must be a JSON object"),
    ],
)
def test_bad_input_is_400_with_a_message(tiny_model_dir, body, message):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            return await api.post("/generate", body)

    status, out = asyncio.run(main())
    assert status == 400
    assert message in out["error"]["message"]


@pytest.mark.parametrize("flags, words", [
    (["--max-running-requests", "0"], "--max-running-requests 0: must be >= 1"),
    (["--max-seq-len", "0"], "--max-seq-len 0: must be >= 1"),
    (["--prefix-cache-entries", "0"], "--prefix-cache-entries 0: must be >= 1"),
    (["--max-queued-requests", "0"], "--max-queued-requests 0: must be >= 1"),
    (["--port", "99999"], "--port 99999: must be in [0, 65535]"),
    (["--device", "gpu"], "--device='gpu' is not a device"),
    (["--weight-version", "-3"], "--weight-version -3: must be >= 0"),
    (["--weight-version", str(2**63)], f"--weight-version {2**63}: must be >= 0 and < 2**63"),
])
def test_server_rejects_bad_arguments_before_loading(tiny_model_dir, capsys, flags, words):
    from areal_async.embedded.server import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-path", str(tiny_model_dir), "--port", "0", *flags])  # the last --port wins
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_server_rejects_a_port_in_use_before_loading(tiny_model_dir, capsys):
    from areal_async.embedded.server import parse_args

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--model-path", str(tiny_model_dir), "--port", str(port)])
    assert exit_info.value.code == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_server_rejects_a_model_path_without_a_model(tmp_path, capsys):
    from areal_async.embedded.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path / "nowhere"), "--port", "0"])  # not the default 30000, which may be in use
    assert "not an HF model directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ids, rid, message",
    [
        ([1, 2], 7, "rid 7 is not a non-empty string"),
        ([1, 2], ["a"], "rid ['a'] is not a non-empty string"),
        ([1, 2], "", "rid '' is not a non-empty string"),
        ([[1, 2], [3]], "a", "rid 'a' is not a list of 2 non-empty strings"),
        ([[1, 2], [3]], ["a", 2], "rid ['a', 2] is not a list of 2 non-empty strings"),
        ([[1, 2], [3]], ["a"], "rid ['a'] is not a list of 2 non-empty strings"),
        ([[1, 2], [3], [4]], ["a", "b", "a"], "rid 'a' is given to 2 prompts of the batch"),
    ],
)
def test_generate_rejects_a_rid_of_the_wrong_shape(tiny_model_dir, ids, rid, message):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, engine):
            bad = await api.post("/generate", {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 2}})
            return bad, engine.num_running

    (status, out), running_after = asyncio.run(main())
    assert status == 400, out
    assert message in out["error"]["message"] and "(or leave rid out)" in out["error"]["message"]
    assert running_after == 0


def test_generate_accepts_sglang_rid_shapes(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            one = await api.post("/generate", {"input_ids": [1, 2], "rid": "x", "sampling_params": {"max_new_tokens": 2}})
            two = await api.post("/generate", {"input_ids": [[1, 2], [3]], "rid": ["p", "q"],
                                               "sampling_params": {"max_new_tokens": 2}})
            anon = await api.post("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}})
            return one, two, anon

    one, two, anon = asyncio.run(main())
    assert one[0] == two[0] == anon[0] == 200
    assert one[1]["meta_info"]["id"] == "x"
    assert [r["meta_info"]["id"] for r in two[1]] == ["p", "q"]
    assert len({r["meta_info"]["id"] for r in anon[1]}) == 2


@pytest.mark.parametrize("bad", [-1, "vocab_size", 10**6])
def test_generate_rejects_stop_token_ids_outside_the_vocabulary(tiny_model_dir, bad):
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    bad = vocab_size if bad == "vocab_size" else bad

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            sampling = {"stop_token_ids": [3, bad], "max_new_tokens": 4}
            return await api.post("/generate", {"input_ids": [1, 2], "sampling_params": sampling})

    status, out = asyncio.run(main())
    assert status == 400, out
    assert f"stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})" in out["error"]["message"]


def test_raised_and_returned_bad_input_answers_have_the_same_shape(tiny_model_dir):
    # a body that is not JSON is refused where the handler raises (_body); both input_ids and text
    # where it returns: both are SGLang's {"error": {"message": ...}} with a JSON content type
    async def main():
        async with running(tiny_model_dir, slots=2, max_seq_len=64) as (api, _):
            answers = []
            for data in (b"{not json", json.dumps({"input_ids": [1, 2], "text": "a"}).encode()):
                async with api.http.post(api.url + "/generate", data=data,
                                         headers={"Content-Type": "application/json"}) as resp:
                    answers.append((resp.status, resp.content_type, resp.charset, json.loads(await resp.text())))
            return answers

    raised, returned = asyncio.run(main())
    for status, content_type, charset, body in (raised, returned):
        assert (status, content_type, charset) == (400, "application/json", "utf-8")
        assert list(body) == ["error"] and list(body["error"]) == ["message"], body
    assert "not JSON" in raised[3]["error"]["message"]
    assert "send either 'input_ids' or 'text', not both" in returned[3]["error"]["message"]


def test_a_rid_held_by_an_unfinished_request_is_refused(tiny_model_dir):
    # /abort_request by rid would stop both requests; the one holding the rid runs on untouched
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            busy = asyncio.create_task(api.generate(prompt, "busy", sampling_seed=1, **kw))
            while engine.num_running == 0:  # admitted: it holds a slot
                await asyncio.sleep(0.005)
            await api.post("/pause_generation", {"mode": "in_place"})  # it stays unfinished meanwhile
            async with asyncio.timeout(30):  # an accepted request would wait for the pause to end
                again = await api.post("/generate", {"input_ids": prompt, "rid": "busy", "sampling_params": kw})
                in_batch = await api.post("/generate", {"input_ids": [prompt, prompt], "rid": ["other", "busy"],
                                                        "sampling_params": kw})
            left = len(engine._unfinished())
            await api.post("/continue_generation", {})
            done = await busy
            reused = await api.generate(prompt, "busy", sampling_seed=1, **kw)  # finished: its rid is free
            return done, again, in_batch, left, reused

    busy, again, in_batch, left, reused = asyncio.run(main())
    for status, out in (again, in_batch):
        assert status == 400, out
        assert "rid 'busy' is already running in another request" in out["error"]["message"], out
    assert left == 1, "a refused batch left a request queued"
    assert busy["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert reused["output_ids"] == busy["output_ids"]


def test_a_rid_taken_between_the_check_and_the_queueing_is_refused(tiny_model_dir):
    # The handler checks the rid, then its request is queued by a task that runs later; a rival
    # queued in between (here: scheduled by the check itself) holds the rid first. The engine
    # refuses the second as it queues it, and the handler answers 400, as for the check.
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, engine):
            checked, rivals = engine.validate, []

            def validate(input_ids, params, rid=None):
                checked(input_ids, params, rid)
                if rid == "raced" and not rivals:
                    rivals.append(asyncio.ensure_future(engine.generate(input_ids, params, rid)))

            engine.validate = validate
            answer = await api.post("/generate", {"input_ids": [1, 2], "rid": "raced",
                                                  "sampling_params": {"max_new_tokens": 2}})
            return answer, len(rivals) and (await rivals[0]).finish_reason

    (status, out), rival = asyncio.run(main())
    assert status == 400, out
    assert "rid 'raced' is already running in another request" in out["error"]["message"], out
    assert rival == "length"


_SHORT = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}  # runs, were its other fields right


@pytest.mark.parametrize("path, body, words", [
    ("/generate", {"text": [1, 2]}, "text [1, 2] is not a string, or a non-empty list of strings"),
    ("/generate", {"text": ["a", 5]}, "text ['a', 5] is not a string"),
    ("/generate", {"text": 5}, "text 5 is not a string"),
    ("/generate", {"text": []}, "text [] is not a string"),
    ("/generate", {**_SHORT, "text": "2 + 2 ="}, "send either 'input_ids' or 'text', not both"),
    ("/generate", {**_SHORT, "return_logprob": "false"}, "return_logprob 'false' is not a JSON boolean"),
    ("/generate", {**_SHORT, "return_logprob": 1}, "return_logprob 1 is not a JSON boolean"),
    ("/generate", {**_SHORT, "stream": "false"}, "stream 'false' is not a JSON boolean"),
    ("/init_weights_update_group", {**JOIN, "rank_offset": None}, "rank_offset None is not an integer"),
    ("/init_weights_update_group", {**JOIN, "rank_offset": [1]}, "rank_offset [1] is not an integer"),
    ("/init_weights_update_group", {**JOIN, "rank_offset": 1.5}, "rank_offset 1.5 is not an integer"),
    ("/init_weights_update_group", {**JOIN, "rank_offset": True}, "rank_offset True is not an integer"),
    ("/init_weights_update_group", {k: v for k, v in JOIN.items() if k != "rank_offset"}, "rank_offset is missing"),
    ("/init_weights_update_group", {**JOIN, "master_port": "x"}, "master_port 'x' is not a port number"),
    ("/init_weights_update_group", {**JOIN, "master_port": 70000}, "master_port 70000 is not a port number"),
    ("/init_weights_update_group", {**JOIN, "world_size": "1.5"}, "world_size '1.5' is not an integer"),
    ("/init_weights_update_group", {**JOIN, "backend": 5}, "backend 5 is not a non-empty string"),
    ("/init_weights_update_group", {**JOIN, "group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/init_weights_update_group", {**JOIN, "master_address": [1]}, "master_address [1] is not a non-empty string"),
    ("/update_weights_from_distributed", {**BUCKET, "names": 5}, "names 5 is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**BUCKET, "names": [5]}, "names [5] is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**BUCKET, "dtypes": [5]}, "dtypes [5] is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**BUCKET, "shapes": [64]}, "shapes [64] is not a list of shapes"),
    ("/update_weights_from_distributed", {**BUCKET, "shapes": [[64.5]]}, "shapes [[64.5]] is not a list of shapes"),
    ("/update_weights_from_distributed", {**BUCKET, "shapes": [[-1]]}, "shapes [[-1]] is not a list of shapes"),
    ("/update_weights_from_distributed", {**BUCKET, "dtypes": "float32"}, "dtypes 'float32' is not a list"),
    ("/update_weights_from_distributed", {**BUCKET, "names": ["a", "b"]}, "names/dtypes/shapes lengths differ: 2/1/1"),
    ("/update_weights_from_distributed", {**BUCKET, "names": ["model.norm.weight"] * 2, "dtypes": ["float32"] * 2,
                                          "shapes": [[64]] * 2}, "names lists 'model.norm.weight' more than once"),
    ("/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[64]]}, "names is missing"),
    ("/update_weights_from_distributed", {**BUCKET, "group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/update_weights_from_distributed", {**BUCKET, "flush_cache": "maybe"}, "flush_cache 'maybe' is not a boolean"),
    ("/update_weights_from_distributed", {**BUCKET, "abort_all_requests": 2}, "abort_all_requests 2 is not a boolean"),
    ("/update_weights_from_distributed", {**BUCKET, "load_format": "direct"}, "load_format 'direct' is not supported"),
    ("/update_weights_from_distributed", BUCKET, "no weight group 'weight_update_group' (joined: none yet)"),
    ("/destroy_weights_update_group", {"group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/update_weights_from_disk", {"model_path": "MODEL", "abort_all_requests": "false"},
     "abort_all_requests 'false' is not a JSON boolean"),
    ("/pause_generation", {"mode": 5}, "mode 5 is not a non-empty string"),
    ("/abort_request", {"rid": ["a", "b"]}, "rid ['a', 'b'] is not a non-empty string"),
    ("/abort_request", {"rid": 5}, "rid 5 is not a non-empty string"),
    ("/abort_request", {"rid": ""}, "rid '' is not a non-empty string"),
    ("/abort_request", {}, 'rid is missing; send one request id as a string, {"rid": "..."}, or {"abort_all": true}'),
    ("/abort_request", {"abort_all": "true"}, "abort_all 'true' is not a JSON boolean"),
])
def test_a_field_of_the_wrong_json_type_is_a_json_400_naming_it(tiny_model_dir, path, body, words):
    # each body has one bad field, checked before anything runs: no join (world_size 1 would refuse
    # rank 1 anyway), no load, no abort; weight endpoints answer SGLang's {success, message}
    body = {k: str(tiny_model_dir) if v == "MODEL" else v for k, v in body.items()}

    async def main():
        async with running(tiny_model_dir, slots=2, max_seq_len=64) as (api, engine):
            return await api.post(path, body), engine.weight_version, engine._paused

    (status, out), version, paused = asyncio.run(main())
    assert status == 400 and isinstance(out, dict), out
    message = out["message"] if path.startswith(("/init", "/update", "/destroy")) else out["error"]["message"]
    assert words in message, message
    assert version == 0 and not paused


def test_text_prompts_are_tokenized_and_empty_text_is_named(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampling = {"max_new_tokens": 3, "temperature": 0.0}

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            one = await api.post("/generate", {"text": "How many", "sampling_params": sampling})
            ids = await api.post("/generate", {"input_ids": tok("How many", add_special_tokens=False)["input_ids"],
                                               "sampling_params": sampling})
            batch = await api.post("/generate", {"text": ["How many", "apples"], "sampling_params": sampling})
            empty = await api.post("/generate", {"text": "", "sampling_params": sampling})
            empty_in_batch = await api.post("/generate", {"text": ["apples", ""], "sampling_params": sampling})
            return one, ids, batch, empty, empty_in_batch

    one, ids, batch, empty, empty_in_batch = asyncio.run(main())
    assert one[0] == ids[0] == batch[0] == 200
    assert one[1]["output_ids"] == ids[1]["output_ids"] == batch[1][0]["output_ids"]
    for status, out in (empty, empty_in_batch):
        assert status == 400 and "text '' has no tokens" in out["error"]["message"], out
        assert "input_ids" not in out["error"]["message"]


def test_return_logprob_false_returns_no_logprobs(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            return [await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                                                 **flag}) for flag in ({"return_logprob": False}, {})]

    for status, out in asyncio.run(main()):
        assert status == 200 and "output_token_logprobs" not in out["meta_info"], out
