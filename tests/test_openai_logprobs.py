"""Per-token log-probs and token ids on ``/v1/completions`` and ``/v1/chat/completions``, over real HTTP
with the tiny fp32 Llama: the stock ``openai`` client gets ``logprobs`` plain and streamed, with
``n > 1``, equal bit for bit to ``/generate``'s ``meta_info.output_token_logprobs`` for the same
prompt and seed; a stream carries every token's entry once, also where a step brings no text; top-k
alternatives and the other values this engine cannot serve are 400s naming the field; SGLang's
``return_token_ids`` / ``return_prompt_token_ids`` / ``sglext`` ids; and (``sglang_ref``) SGLang's
own log-prob builders, run over the same tokens, give the same objects, and its request classes read
the same fields with the same meaning (or run what is a 400 here by design)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.embedded.openai_api import OpenAIError, _chat_returns, _completion_returns
from areal_async.embedded.openai_choices import LogprobRenderer
from areal_async.types import sample_seed
from tests.support.sglang_ref import needs_sglang, run_sglang
from tests.support.openai_http import PROMPT, chat_ids, events, post

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 5


@contextlib.asynccontextmanager
async def running(model_dir, deterministic: bool = False):
    # deterministic: the batch-invariant forward, so n choices run together give the log-probs of
    # each run alone (the default forward may differ in the last bits with the batch's make-up)
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", 8, 256, prefix_cache=False,
                                    deterministic=deterministic)
    server = InferenceServer(engine, tokenizer, str(model_dir))
    async with serve(server) as url, aiohttp.ClientSession() as http:
        yield url, http


async def generated(http, url: str, ids: list[int], sampling: dict, seeds: list[int]) -> list[dict]:
    """``/generate`` of ``ids`` once per seed, with its log-probs and their token texts."""
    out = []
    for seed in seeds:
        status, gen = await post(http, url + "/generate", {
            "input_ids": ids, "sampling_params": {**sampling, "sampling_seed": seed}, "return_logprob": True,
            "return_text_in_logprobs": True})
        assert status == 200, gen
        out.append(gen)
    return out


def lps(gen: dict) -> list[float]:
    return [e[0] for e in gen["meta_info"]["output_token_logprobs"]]


def test_the_openai_client_gets_generates_own_logprobs(tiny_model_dir):
    openai = pytest.importorskip("openai")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Natalia sold clips to"
    ids, chat_prompt = tok(text, add_special_tokens=False)["input_ids"], chat_ids(tiny_model_dir, PROMPT)
    sampling = {"max_new_tokens": 12, "temperature": 1.0}
    seeds = [SEED, sample_seed(SEED, 0, 1)]  # choice 0 and choice 1 of n = 2

    async def main():
        async with running(tiny_model_dir, deterministic=True) as (url, http):
            gen = await generated(http, url, ids, sampling, seeds)
            chat_gen = await generated(http, url, chat_prompt, sampling, seeds)
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            common = dict(model="m", max_tokens=12, temperature=1.0, seed=SEED, n=2)
            plain = await client.completions.create(prompt=text, logprobs=0, **common)
            streamed = [c async for c in await client.completions.create(prompt=text, logprobs=0, stream=True,
                                                                          **common)]
            chat = await client.chat.completions.create(messages=PROMPT, logprobs=True, top_logprobs=0, **common)
            chat_streamed = [c async for c in await client.chat.completions.create(
                messages=PROMPT, logprobs=True, stream=True, **common)]
            await client.close()
            return gen, chat_gen, plain, streamed, chat, chat_streamed

    gen, chat_gen, plain, streamed, chat, chat_streamed = asyncio.run(main())
    for i in range(2):
        entries = gen[i]["meta_info"]["output_token_logprobs"]
        got = plain.choices[i].logprobs
        assert plain.choices[i].text == gen[i]["text"]
        assert got.token_logprobs == lps(gen[i])  # exactly: the engine's numbers, not recomputed
        # each token decoded alone (a fragment of a character: its bytes as latin-1, checked against SGLang below)
        assert [t for t, e in zip(got.tokens, entries) if "\ufffd" not in e[2]] == [
            e[2] for e in entries if "\ufffd" not in e[2]]
        assert got.text_offset == [-1] * len(entries) and got.top_logprobs == []  # as SGLang answers
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == i]
        assert [x for c in mine for x in c.logprobs.token_logprobs] == lps(gen[i])
        assert [x for c in mine for x in c.logprobs.tokens] == got.tokens

        content = chat.choices[i].logprobs.content
        assert chat.choices[i].message.content == chat_gen[i]["text"]
        assert [e.logprob for e in content] == lps(chat_gen[i])
        assert [e.token for e in content] == [e[2] for e in chat_gen[i]["meta_info"]["output_token_logprobs"]]
        assert all(bytes(e.bytes).decode() == e.token for e in content if "\ufffd" not in e.token)
        assert all(e.top_logprobs == [] for e in content)
        mine = [c.choices[0] for c in chat_streamed if c.choices and c.choices[0].index == i]
        assert [e.logprob for c in mine if c.logprobs for e in c.logprobs.content] == lps(chat_gen[i])
        assert "".join(c.delta.content or "" for c in mine) == chat.choices[i].message.content
    assert lps(gen[0]) != lps(gen[1])  # the two choices are two samples


def test_a_stream_carries_every_tokens_entry_once_where_steps_bring_no_text(tiny_model_dir):
    # steps that bring no text: a byte of a character not yet whole (the stream holds U+FFFD back),
    # text that may begin the stop string, the stop string itself (trimmed), a stop token (never
    # text); their entries go with the next chunk that has text, or with the finishing one
    chat_prompt = chat_ids(tiny_model_dir, PROMPT)
    sampled = {"max_new_tokens": 24, "temperature": 1.0}

    async def main():
        async with running(tiny_model_dir) as (url, http):
            [free] = await generated(http, url, chat_prompt, sampled, [SEED])
            stop, stop_id = free["text"][8:11], free["output_ids"][6]
            cases = []
            for extra in ({"stop": stop}, {"stop_token_ids": [stop_id]}):
                body = {"messages": PROMPT, "max_tokens": 24, "seed": SEED, "logprobs": True, **extra}
                [gen] = await generated(http, url, chat_prompt, {**sampled, **extra}, [SEED])
                status, plain = await post(http, url + "/v1/chat/completions", body)
                assert status == 200, plain
                cases.append((gen, plain, await events(http, url + "/v1/chat/completions", {**body, "stream": True})))
            return stop, cases

    stop, cases = asyncio.run(main())
    assert "\ufffd" not in stop and len(stop) == 3, stop
    for gen, plain, chunks in cases:
        assert plain["choices"][0]["finish_reason"] == "stop"
        choices = [c["choices"][0] for c in chunks]
        carried = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
        assert carried == plain["choices"][0]["logprobs"]["content"]  # each entry once, in order
        assert [e["logprob"] for e in carried] == lps(gen)
        assert all(c["delta"].get("content") or c["finish_reason"] for c in choices if c["logprobs"])
        assert any(len(c["logprobs"]["content"]) > 1 for c in choices if c["logprobs"] and c["delta"].get("content"))
        assert choices[-1]["logprobs"] is not None  # the tokens after the last text: the stop's
    (_, stopped, _), (gen, _, token_chunks) = cases
    assert stop not in stopped["choices"][0]["message"]["content"]
    last = token_chunks[-1]["choices"][0]  # the stop token is in output_ids, never in the text
    assert last["matched_stop"] == gen["output_ids"][-1] and [e["logprob"] for e in last["logprobs"]["content"]] == \
        lps(gen)[-1:]


def test_completions_stream_and_answer_shapes_with_token_ids(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["Natalia sold clips to", "Weng earns"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    sampling = {"max_new_tokens": 6, "temperature": 1.0}

    async def main():
        async with running(tiny_model_dir, deterministic=True) as (url, http):
            gens = [await generated(http, url, p, sampling, [SEED, sample_seed(SEED, 0, 1)]) for p in ids]
            body = {"prompt": prompts, "max_tokens": 6, "seed": SEED, "n": 2, "logprobs": 0, "return_token_ids": True}
            plain = await post(http, url + "/v1/completions", body)
            bare = await post(http, url + "/v1/completions", {**body, "logprobs": None, "return_token_ids": False})
            prefill = await post(http, url + "/v1/completions", {**body, "max_tokens": 0})
            return gens, plain, bare, prefill, await events(http, url + "/v1/completions", {**body, "stream": True})

    gens, (status, plain), (_, bare), (_, prefill), chunks = asyncio.run(main())
    assert status == 200, plain
    for k, choice in enumerate(plain["choices"]):  # choice index = prompt * n + sample
        gen = gens[k // 2][k % 2]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "matched_stop", "token_ids",
                                "prompt_token_ids"]
        assert choice["token_ids"] == gen["output_ids"] and choice["prompt_token_ids"] == ids[k // 2]
        assert choice["logprobs"] == {"text_offset": [-1] * len(gen["output_ids"]), "token_logprobs": lps(gen),
                                      "tokens": choice["logprobs"]["tokens"], "top_logprobs": []}
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert [t for c in mine for t in c["token_ids"]] == gen["output_ids"]
        assert [c.get("prompt_token_ids") for c in mine] == [ids[k // 2]] + [None] * (len(mine) - 1)
        assert [x for c in mine for x in c["logprobs"]["token_logprobs"]] == lps(gen)
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason", "matched_stop"} and c["logprobs"] is None
               for c in bare["choices"])  # not asked: SGLang's keys and no more
    assert prefill["choices"][0]["logprobs"] == {"text_offset": [], "token_logprobs": [], "tokens": [],
                                                 "top_logprobs": []} and prefill["choices"][0]["token_ids"] == []


def test_chat_token_ids_and_sglext_ids(tiny_model_dir):
    chat_prompt = chat_ids(tiny_model_dir, PROMPT)
    body = {"messages": PROMPT, "max_tokens": 5, "seed": SEED, "n": 2}

    async def main():
        async with running(tiny_model_dir, deterministic=True) as (url, http):
            gens = await generated(http, url, chat_prompt, {"max_new_tokens": 5}, [SEED, sample_seed(SEED, 0, 1)])
            url += "/v1/chat/completions"
            both = await post(http, url, {**body, "return_token_ids": True})
            prompt_only = await post(http, url, {**body, "return_prompt_token_ids": True})
            ext = await post(http, url, {**body, "return_input_ids_in_sglext": True,
                                         "return_output_ids_in_sglext": True})
            streamed = await events(http, url, {**body, "stream": True, "return_output_ids_in_sglext": True,
                                                "stream_options": {"include_usage": True}})
            async with http.post(url, json={**body, "stream": True}, headers={
                    "x-sglext-return-input-ids": "1", "x-sglext-ids-framed": "1"}) as resp:
                framed = (await resp.read()).decode()
            return gens, both, prompt_only, ext, streamed, framed

    gens, (s1, both), (s2, prompt_only), (s3, ext), streamed, framed = asyncio.run(main())
    assert (s1, s2, s3) == (200, 200, 200)
    outputs = [g["output_ids"] for g in gens]
    assert [c["prompt_token_ids"] for c in both["choices"]] == [chat_prompt] * 2
    assert [c["response_token_ids"] for c in both["choices"]] == outputs
    assert [set(c) - {"prompt_token_ids"} for c in prompt_only["choices"]] == [
        {"index", "message", "logprobs", "finish_reason", "matched_stop"}] * 2
    assert ext["sglext"] == {"input_ids": chat_prompt, "output_ids": outputs} and "sglext" not in both
    *_, sglext, usage = streamed  # after every choice's last chunk, before the usage chunk
    assert sglext["choices"] == [] and sglext["sglext"] == {"output_ids": outputs} and "usage" in usage
    event = framed.split("\n\n")[-3]  # a named event, for proxies that pick the ids out
    assert event.startswith("event: sglext_ids\ndata: ")
    assert json.loads(event.split("data: ", 1)[1])["sglext"] == {"input_ids": chat_prompt}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "return_token_ids": 1}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": PROMPT, "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": PROMPT, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": PROMPT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": PROMPT, "stream": True, "return_token_ids": True}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": PROMPT, "stream": True, "return_prompt_token_ids": True},
     "return_prompt_token_ids"),
])
def test_what_this_engine_cannot_serve_is_a_400_naming_the_field(tiny_model_dir, path, body, param):
    async def main():
        async with running(tiny_model_dir) as (url, http):
            return await post(http, url + path, body), await post(
                http, url + "/v1/chat/completions", {"messages": PROMPT, "max_tokens": 2, "top_logprobs": 5})

    (status, out), (ignored_status, ignored) = asyncio.run(main())
    assert status == 400 and out["error"]["param"] == param and param in out["error"]["message"], out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["code"] == 400
    if out["error"]["message"].startswith(f"{param} {body[param]} asks for"):  # names what is served
        assert "sampled token's log-prob only" in out["error"]["message"] and "send 0" in out["error"]["message"]
    # top_logprobs without logprobs asks for nothing: accepted, as SGLang does
    assert ignored_status == 200 and ignored["choices"][0]["logprobs"] is None


# ---- against SGLang's own code ----------------------------------------------------------------------

# Runs in .venv-sglang: SGLang's token-text step (TokenizerManager.detokenize_logprob_tokens), its
# completions builder (utils.to_openai_style_logprobs) and its chat builder
# (OpenAIServingChat._build_token_logprobs_from_raw), the two methods taken from the source files
# (importing those modules needs fastapi, which .venv-sglang does not hold); then its request
# classes (CompletionRequest, ChatCompletionRequest) on each body.
_SGLANG_SIDE = r'''
import ast, json, sys, types
from typing import Any
import pydantic
from transformers import AutoTokenizer
import sglang.srt.entrypoints.openai.utils as utils
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionTokenLogprob,
                                                    CompletionRequest, TopLogprob)
from sglang.srt.managers import io_struct

job = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(job["tokenizer"])
root = io_struct.__file__.rsplit("/managers/", 1)[0]

def method(path, cls, name):
    tree = ast.parse(open(f"{root}/{path}").read())
    return next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name)

ns = {"Any": Any, "List": list, "token_id_to_bytes": utils.token_id_to_bytes, "TopLogprob": TopLogprob,
      "ChatCompletionTokenLogprob": ChatCompletionTokenLogprob}
defs = [method("managers/tokenizer_manager.py", "TokenizerManager", "detokenize_logprob_tokens"),
        method("entrypoints/openai/serving_chat.py", "OpenAIServingChat", "_build_token_logprobs_from_raw")]
exec(compile(ast.Module(defs, []), "sglang", "exec"), ns)
me = types.SimpleNamespace(tokenizer=tok, tokenizer_manager=types.SimpleNamespace(tokenizer=tok))
out = []
for case in job["cases"]:
    triples = ns["detokenize_logprob_tokens"](me, case["logprobs"], case["ids"], True)
    completion = utils.to_openai_style_logprobs(output_token_logprobs=triples, output_top_logprobs=[], tokenizer=tok)
    chat = ns["_build_token_logprobs_from_raw"](me, triples, None)
    out.append({"completion": completion.model_dump(), "chat": {"content": [e.model_dump() for e in chat]}})
asked = []  # the request classes' reading, and what _convert_to_internal_request asks the engine for
for endpoint, body in job["bodies"]:
    try:
        if endpoint == "completions":
            r = CompletionRequest(prompt="a", **body)
            asked.append({"return_logprob": r.logprobs is not None, "top_logprobs_num": r.logprobs or 0,
                          "return_token_ids": r.return_token_ids})
        else:
            r = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], **body)
            asked.append({"return_logprob": r.logprobs, "top_logprobs_num": r.top_logprobs or 0,
                          "return_token_ids": r.return_token_ids, "return_prompt_token_ids": r.return_prompt_token_ids,
                          "sglext": [r.return_input_ids_in_sglext, r.return_output_ids_in_sglext]})
    except pydantic.ValidationError as exc:
        asked.append({"refused": str(exc)[:200]})
print(json.dumps({"built": out, "asked": asked}))
'''

# (endpoint, body, what SGLang's engine request asks for) that both accept with that meaning; the
# top-k counts it runs (and negative ones, which it runs as 0) are 400s here, naming the field
SAME = [
    ("completions", {"logprobs": 0}, {"return_logprob": True, "top_logprobs_num": 0, "return_token_ids": False}),
    ("completions", {"logprobs": None, "return_token_ids": True},
     {"return_logprob": False, "top_logprobs_num": 0, "return_token_ids": True}),
    ("chat", {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_prompt_token_ids": True},
     {"return_logprob": True, "top_logprobs_num": 0, "return_token_ids": True, "return_prompt_token_ids": True,
      "sglext": [False, False]}),
    ("chat", {"logprobs": False, "top_logprobs": 5, "return_input_ids_in_sglext": True,
              "return_output_ids_in_sglext": True},  # SGLang computes the 5 and returns nothing
     {"return_logprob": False, "top_logprobs_num": 5, "return_token_ids": False, "return_prompt_token_ids": False,
      "sglext": [True, True]}),
]
OURS_ONLY = [("completions", {"logprobs": 1}), ("completions", {"logprobs": -1}),
             ("chat", {"logprobs": True, "top_logprobs": 5}), ("chat", {"top_logprobs": -1})]


@pytest.mark.sglang_ref
@needs_sglang
def test_sglangs_own_code_builds_the_same_logprobs_and_reads_the_same_requests(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(["Natalia sold clips to"], add_special_tokens=False)["input_ids"][0]
    body = {"prompt": ids, "max_tokens": 48, "temperature": 1.0, "seed": 11, "n": 3, "logprobs": 0,
            "return_token_ids": True}

    async def main():
        async with running(tiny_model_dir) as (url, http):
            status, plain = await post(http, url + "/v1/completions", body)
            chat_status, chat = await post(http, url + "/v1/chat/completions", {
                "messages": PROMPT, "max_tokens": 48, "temperature": 1.0, "seed": 11, "n": 3, "logprobs": True,
                "return_token_ids": True})
            assert (status, chat_status) == (200, 200), (plain, chat)
            return plain, chat

    plain, chat = asyncio.run(main())
    served = [(c["token_ids"], c["logprobs"]["token_logprobs"], "completion", c["logprobs"]) for c in plain["choices"]]
    served += [(c["response_token_ids"], [e["logprob"] for e in c["logprobs"]["content"]], "chat", c["logprobs"])
               for c in chat["choices"]]
    # and every token of the vocabulary once: special tokens, byte fragments, whole words
    every = list(range(len(tok)))
    render = LogprobRenderer(tok)
    served += [(every, [-1.5] * len(every), "completion", render.completion(every, [-1.5] * len(every))),
               (every, [-1.5] * len(every), "chat", render.chat(every, [-1.5] * len(every)))]
    theirs = run_sglang(_SGLANG_SIDE, {"tokenizer": str(tiny_model_dir), "cases": [
        {"ids": i, "logprobs": lp} for i, lp, _, _ in served], "bodies": [
        (e, b) for e, b, *_ in SAME + OURS_ONLY]}, timeout=240)
    for (endpoint, body, meaning), asked in zip(SAME, theirs["asked"]):
        assert asked == meaning, (endpoint, body, asked)
        ours = _completion_returns(body) if endpoint == "completions" else _chat_returns(body, {})
        assert (ours.logprobs, ours.token_ids) == (meaning["return_logprob"], meaning["return_token_ids"])
        if endpoint == "chat":
            assert [ours.prompt_ids, ours.sglext_input_ids, ours.sglext_output_ids] == [
                meaning["return_prompt_token_ids"], *meaning["sglext"]]
    for (endpoint, body), asked in zip(OURS_ONLY, theirs["asked"][len(SAME):]):
        assert "refused" not in asked, (endpoint, body, asked)  # SGLang runs it
        with pytest.raises(OpenAIError) as refused:
            _completion_returns(body) if endpoint == "completions" else _chat_returns(body, {})
        assert refused.value.param in body and refused.value.status == 400
    fragments = [t for t in every if "\ufffd" in tok.decode([t])]
    assert fragments, "the vocabulary has byte tokens that are not whole characters: the latin-1 / bytes cases"
    assert any(set(i) & set(fragments) for i, _, kind, _ in served[:-2]), "a sampled output hits a fragment"
    for (ids_, _, kind, ours), sglang in zip(served, theirs["built"]):
        assert ours == sglang[kind], (kind, ids_[:10])
