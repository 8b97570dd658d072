"""Streaming ``/generate`` and the OpenAI-compatible ``/v1`` endpoints of the embedded server, over
real HTTP with the tiny fp32 Llama: streamed chunks against the plain answer, the stream interval,
a client hanging up mid-stream, the ``/v1`` shapes and errors, the ``openai`` client, and SGLang's
own ``bench_serving`` (its default backend streams and waits on ``/v1/models``)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.types import sample_seed
from tests.support.openai_http import PROMPT, chat_ids, events, post
from tests.support.sglang_ref import needs_sglang, sglang_env, SGLANG_PYTHON

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextlib.asynccontextmanager
async def running(model_dir, slots: int = 8, max_seq_len: int = 256, stream_interval: int = 1):
    # no prompt reuse: a prompt sent twice reports the same cached_tokens (0) both times
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", slots, max_seq_len, prefix_cache=False)
    server = InferenceServer(engine, tokenizer, str(model_dir), stream_interval=stream_interval)
    async with serve(server) as url, aiohttp.ClientSession() as http:
        yield url, http, engine


def _timeless(meta: dict) -> dict:
    """``meta_info`` less ``e2e_latency`` (seconds of wall clock, different in every answer)."""
    return {k: v for k, v in meta.items() if k != "e2e_latency"}




@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7}])
def test_streamed_generate_chunks_grow_to_the_plain_answer(tiny_model_dir, sampling):
    prompt = chat_ids(tiny_model_dir, PROMPT)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **sampling}, "return_logprob": True}

    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            status, plain = await post(http, url + "/generate", body)
            assert status == 200, plain
            streamed = await events(http, url + "/generate", {**body, "stream": True, "rid": "s1"})
            return plain, streamed

    plain, chunks = asyncio.run(main())
    n = len(plain["output_ids"])
    # interval 1: one chunk per committed token, each cumulative (SGLang's default), the last the answer
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, n + 1))
    final = chunks[-1]
    assert final["text"] == plain["text"] and final["output_ids"] == plain["output_ids"]
    assert final["meta_info"]["e2e_latency"] > 0  # a wall-clock time: the one key that differs
    assert _timeless(final["meta_info"]) == _timeless({**plain["meta_info"], "id": "s1"})
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][:-1] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
        assert before["meta_info"]["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"][
            : len(before["output_ids"])]
        assert before["meta_info"]["completion_tokens"] == len(before["output_ids"])
        assert before["meta_info"]["prompt_tokens"] == len(prompt) and "index" not in before


def test_streamed_batch_and_stream_interval(tiny_model_dir):
    prompts = [chat_ids(tiny_model_dir, PROMPT), chat_ids(tiny_model_dir, [{"role": "user", "content": "Hi"}])]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}}

    async def main():
        async with running(tiny_model_dir, stream_interval=3) as (url, http, _):
            status, plain = await post(http, url + "/generate", body)
            assert status == 200, plain
            return plain, await events(http, url + "/generate", {**body, "stream": True})

    plain, chunks = asyncio.run(main())
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        # interval 3 (SGLang's rule): the first token at once, then each time 3 are unsent; the
        # 10th token finishes the request, and a finished request is sent whatever is unsent
        assert [len(c["output_ids"]) for c in mine] == [1, 4, 7, 10]
        final = {k: mine[-1][k] for k in ("text", "output_ids", "meta_info")}
        assert {**final, "meta_info": _timeless(final["meta_info"])} == {
            **plain[i], "meta_info": _timeless({**plain[i]["meta_info"], "id": final["meta_info"]["id"]})}
    assert {c["index"] for c in chunks} == {0, 1}


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(tiny_model_dir):
    prompt = chat_ids(tiny_model_dir, PROMPT)

    async def main():
        async with running(tiny_model_dir, max_seq_len=2048) as (url, http, engine):
            body = {"input_ids": prompt, "stream": True,
                    "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            async with aiohttp.ClientSession() as gone:
                resp = await gone.post(url + "/generate", json=body)
                first = await resp.content.readuntil(b"\n\n")
                assert engine.num_running == 1
                resp.close()  # hangs up
            steps = 0
            while engine.num_running and steps < 200:
                await engine.next_step()
                steps += 1
            status, after = await post(http, url + "/generate", {"input_ids": prompt,
                                                                 "sampling_params": {"max_new_tokens": 2}})
            return first, steps, status, after

    first, steps, status, after = asyncio.run(main())
    assert json.loads(first[len(b"data: "):])["meta_info"]["finish_reason"] is None
    # aborted within a few steps of the hang-up, not after the 1500 tokens it asked for
    assert steps < 50, f"the request ran {steps} more steps after its client went away"
    assert status == 200 and len(after["output_ids"]) <= 2


def test_an_aborted_stream_ends_with_its_abort_chunk(tiny_model_dir):
    prompt = chat_ids(tiny_model_dir, PROMPT)

    async def main():
        async with running(tiny_model_dir, max_seq_len=2048) as (url, http, engine):
            body = {"input_ids": prompt, "rid": "a1", "stream": True,
                    "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            async with http.post(url + "/generate", json=body) as resp:
                first = await resp.content.readuntil(b"\n\n")
                aborted = await post(http, url + "/abort_request", {"rid": "a1"})
                rest = (await resp.read()).decode().split("\n\n")
            return first, aborted, rest, engine.num_running

    first, aborted, rest, running_after = asyncio.run(main())
    assert aborted == (200, {"success": True, "message": "aborted 1 request(s)"})
    *chunks, done, tail = rest
    assert (done, tail) == ("data: [DONE]", "")
    last = json.loads(chunks[-1][len("data: "):])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
    assert len(last["output_ids"]) < 1500 and last["output_ids"][:1] == json.loads(first[6:])["output_ids"]
    assert running_after == 0


def test_broken_weights_end_a_stream_with_an_error_event(tiny_model_dir, tmp_path):
    # a NaN norm makes every logit NaN: a stream must not send the NaN (JSON has none) nor its tokens
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")

    async def main():
        async with running(tiny_model_dir) as (url, http, engine):
            status, loaded = await post(http, url + "/update_weights_from_disk",
                                        {"model_path": str(tmp_path / "nan"), "weight_version": "3"})
            assert status == 200, loaded
            body = {"input_ids": [1, 2], "rid": "b1", "stream": True, "sampling_params": {"max_new_tokens": 4}}
            generate = await events(http, url + "/generate", body)
            chat = await events(http, url + "/v1/chat/completions", {"messages": PROMPT, "stream": True})
            plain = await post(http, url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 4})
            return generate, chat, plain, engine.num_running

    generate, chat, (status, plain), running_after = asyncio.run(main())
    assert generate == [{"error": {"message": generate[0]["error"]["message"], "type": "server_error", "code": 500,
                                   "retryable": False}}]
    assert "non-finite log-probs (NaN or inf) for rid 'b1'" in generate[0]["error"]["message"]
    assert "under weight version 3" in generate[0]["error"]["message"]
    # the chat stream opens no choice: its first chunk already had a NaN log-prob
    assert len(chat) == 1 and chat[0]["error"]["code"] == 500 and "non-finite" in chat[0]["error"]["message"]
    assert status == 500 and plain["error"]["type"] == "server_error" and "non-finite" in plain["error"]["message"]
    assert running_after == 0


def test_v1_models_and_completions(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Natalia sold clips to"
    ids = tok(text, add_special_tokens=False)["input_ids"]

    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            async with http.get(url + "/v1/models") as resp:
                models = resp.status, await resp.json()
            async with http.get(url + f"/v1/models/{tiny_model_dir}") as resp:
                card = resp.status, await resp.json()
            async with http.get(url + "/v1/models/nope") as resp:
                missing = resp.status, await resp.json()
            req = {"model": "x", "prompt": text, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 2,
                   "logprobs": None, "user": "u1", "unknown_field": 3}
            plain = await post(http, url + "/v1/completions", req)
            gen = [await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": seed}}) for seed in (5, sample_seed(5, 0, 1))]
            streamed = await events(http, url + "/v1/completions",
                                    {**req, "stream": True, "stream_options": {"include_usage": True}})
            return models, card, missing, plain, gen, streamed

    models, card, missing, (status, plain), gen, streamed = asyncio.run(main())
    assert models[0] == 200 and models[1]["object"] == "list" and len(models[1]["data"]) == 1
    model = models[1]["data"][0]
    assert model["id"] == str(tiny_model_dir) and model["object"] == "model" and model["max_model_len"] == 256
    assert card == (200, model) or (card[0] == 200 and card[1]["id"] == model["id"])
    assert missing[0] == 404 and missing[1]["error"]["code"] == "model_not_found"

    assert status == 200, plain
    assert plain["object"] == "text_completion" and plain["model"] == "x" and plain["id"].startswith("cmpl-")
    # choice 0 is the /generate with sampling_seed = seed, choice 1 the one seeded sample_seed(seed, 0, 1)
    assert [c["text"] for c in plain["choices"]] == [g[1]["text"] for g in gen]
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in plain["choices"]] == [g[1]["meta_info"]["finish_reason"]["type"] for g in gen]
    completion = sum(len(g[1]["output_ids"]) for g in gen)
    assert plain["usage"]["prompt_tokens"] == len(ids)  # counted once for the n choices of one prompt
    assert plain["usage"]["completion_tokens"] == completion
    assert plain["usage"]["total_tokens"] == len(ids) + completion
    assert plain["metadata"] == {"weight_version": "0"}

    *chunks, usage = streamed
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == plain["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == plain["choices"][i]["finish_reason"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)


def test_v1_chat_completions(tiny_model_dir):
    ids = chat_ids(tiny_model_dir, PROMPT)
    messages = [{"role": "user", "content": [{"type": "text", "text": "How many apples "},
                                             {"type": "text", "text": "are left?"}]}]

    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            req = {"model": "m", "messages": messages, "max_tokens": 10, "temperature": 0.0, "logprobs": False,
                   "tools": [], "response_format": {"type": "text"}}
            plain = await post(http, url + "/v1/chat/completions", req)
            status, gen = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0.0}})
            assert status == 200
            streamed = await events(http, url + "/v1/chat/completions",
                                    {**req, "stream": True, "stream_options": {"include_usage": True}})
            unbounded = await post(http, url + "/v1/chat/completions",
                                   {"messages": PROMPT, "temperature": 0.0, "ignore_eos": True})
            return plain, gen, streamed, unbounded

    (status, plain), gen, streamed, (ustatus, unbounded) = asyncio.run(main())
    assert status == 200, plain
    choice = plain["choices"][0]
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-") and plain["model"] == "m"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == gen["text"]
    assert choice["finish_reason"] == gen["meta_info"]["finish_reason"]["type"]
    assert plain["usage"]["prompt_tokens"] == len(ids)
    assert plain["usage"]["completion_tokens"] == len(gen["output_ids"])

    *chunks, usage = streamed
    deltas = [c["choices"][0] for c in chunks]
    assert deltas[0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert deltas[-1]["delta"] == {"reasoning_content": None} and deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == gen["text"]
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    # no max_tokens: as many tokens as fit the server's max_seq_len (256)
    assert ustatus == 200 and unbounded["usage"]["completion_tokens"] == 256 - len(ids), unbounded


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "a", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": True}, "n"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "model": 7}, "model"),
    ("/v1/chat/completions", {"messages": PROMPT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "a", "top_p": 0.0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/chat/completions", {"messages": PROMPT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"messages": PROMPT, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
])
def test_v1_refuses_what_it_cannot_honour_with_openai_errors(tiny_model_dir, path, body, param):
    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            return await post(http, url + path, body)

    status, out = asyncio.run(main())
    assert status == 400, out
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    assert out["error"]["code"] == 400 and param.split(".")[0] in out["error"]["message"], out


def test_v1_names_a_field_of_the_wrong_json_type_its_value_and_what_to_send(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            return [await post(http, url + "/v1/completions", {"prompt": "a", **field}) for field in
                    ({"max_tokens": True}, {"stream": "yes"}, {"stream_options": 3})]

    (s1, o1), (s2, o2), (s3, o3) = asyncio.run(main())
    assert (s1, s2, s3) == (400, 400, 400)
    assert o1["error"]["message"] == "max_tokens True is not an integer; send an integer (or leave max_tokens out)"
    assert o2["error"]["message"] == ("stream 'yes' is not a JSON boolean (true or false); send a JSON boolean "
                                      "(true or false) (or leave stream out)")
    assert o3["error"]["message"] == "stream_options 3 is not a JSON object; send a JSON object (or leave stream_options out)"


def test_the_openai_client(tiny_model_dir):
    openai = pytest.importorskip("openai")
    ids = chat_ids(tiny_model_dir, PROMPT)

    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            models = await client.models.list()
            status, gen = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0.0}})
            completion = await client.completions.create(model=models.data[0].id, prompt=ids, max_tokens=8,
                                                         temperature=0.0)
            stream = await client.completions.create(model=models.data[0].id, prompt=ids, max_tokens=8,
                                                     temperature=0.0, stream=True)
            streamed = [chunk async for chunk in stream]
            chat = await client.chat.completions.create(model=models.data[0].id, messages=PROMPT, max_tokens=8,
                                                        temperature=0.0, seed=3)
            chat_stream = await client.chat.completions.create(
                model=models.data[0].id, messages=PROMPT, max_tokens=8, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
            chat_streamed = [chunk async for chunk in chat_stream]
            await client.close()
            return models, gen, completion, streamed, chat, chat_streamed

    models, gen, completion, streamed, chat, chat_streamed = asyncio.run(main())
    assert [m.id for m in models.data] == [str(tiny_model_dir)]
    assert completion.choices[0].text == gen["text"] and completion.usage.completion_tokens == len(gen["output_ids"])
    assert "".join(c.choices[0].text for c in streamed) == gen["text"]
    assert chat.choices[0].message.content == gen["text"] and chat.choices[0].message.role == "assistant"
    *chunks, usage = chat_streamed
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == gen["text"]
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.total_tokens == chat.usage.total_tokens


SHAREGPT = [  # the shape of SGLang's ShareGPT file, which its "random" dataset cuts prompts from
    {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "The answer is 42."}]}
    for q in ["Natalia sold clips to 48 of her friends in April.", "Weng earns $12 an hour for babysitting.",
              "Betty is saving money for a new wallet which costs $100.", "James writes a 3-page letter."]
]


@pytest.mark.sglang_ref
@needs_sglang
def test_sglang_bench_serving_completes_against_the_embedded_server(tiny_model_dir, tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(SHAREGPT))
    result = tmp_path / "bench.jsonl"

    async def main():
        async with running(tiny_model_dir) as (url, _, _):
            # its default flags: backend sglang streams /generate and waits on /v1/models first
            proc = await asyncio.create_subprocess_exec(
                str(SGLANG_PYTHON), "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
                "--dataset-name", "random", "--dataset-path", str(dataset), "--random-input-len", "16",
                "--random-output-len", "8", "--num-prompts", "4", "--tokenizer", str(tiny_model_dir),
                "--output-file", str(result), "--disable-tqdm",
                cwd=tmp_path, env=sglang_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
            return proc.returncode, out.decode()

    code, out = asyncio.run(main())
    assert code == 0, out[-4000:]
    record = json.loads(result.read_text().splitlines()[-1])
    assert record["completed"] == 4, out[-4000:]
    assert "Successful requests:                     4" in out, out[-4000:]
    assert record["total_output_tokens"] > 0, record


def test_v1_trims_the_stop_as_generate_does_and_streams_no_text_it_trims(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "Natalia sold clips to"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]

    async def main():
        async with running(tiny_model_dir) as (url, http, _):
            greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
            _, free = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": greedy})
            stop = free["text"][5:8]  # a stop string the greedy answer does reach
            assert len(stop) == 3, free["text"]
            _, gen = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {**greedy, "stop": stop}})
            req = {"model": "x", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": stop}
            status, plain = await post(http, url + "/v1/completions", req)
            chunks = await events(http, url + "/v1/completions", {**req, "stream": True})
            _, kept = await post(http, url + "/v1/completions", {**req, "no_stop_trim": True})
            return stop, gen, status, plain, chunks, kept

    stop, gen, status, plain, chunks, kept = asyncio.run(main())
    assert gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop} and stop not in gen["text"]
    assert status == 200 and plain["choices"][0]["text"] == gen["text"]  # the stop string is not in the answer
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == gen["text"]  # no delta sent and trimmed
    assert kept["choices"][0]["text"] == gen["text"] + stop


def test_prefill_only_requests_stream_and_answer_on_v1(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir) as (url, http, engine):
            streamed = await events(http, url + "/generate", {"text": "hi", "stream": True,
                                                              "sampling_params": {"max_new_tokens": 0}})
            batch = await events(http, url + "/generate", {
                "text": ["a", "b"], "stream": True, "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 2}]})
            status, plain = await post(http, url + "/v1/completions", {"model": "x", "prompt": "a", "max_tokens": 0})
            chat = await events(http, url + "/v1/chat/completions", {
                "model": "x", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0, "stream": True})
            return streamed, batch, status, plain, chat, engine.num_running

    streamed, batch, status, plain, chat, left = asyncio.run(main())
    assert len(streamed) == 1 and streamed[0]["output_ids"] == [] and streamed[0]["text"] == ""
    assert streamed[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert finals[0]["output_ids"] == [] and len(finals[1]["output_ids"]) == 2
    assert status == 200 and plain["choices"][0]["text"] == "" and plain["choices"][0]["finish_reason"] == "length"
    finished = [c["choices"][0]["finish_reason"] for c in chat if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finished == ["length"]
    assert left == 0
