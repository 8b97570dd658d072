"""``/generate`` accepts what SGLang 0.5.23 accepts, with SGLang's meaning.

Two kinds of tests:

- marked ``sglang_ref`` (+ ``needs_sglang``): every body SGLang's clients send (slime's, AReaL's, the frontend's) and the new fields is
  decoded by SGLang's own code in ``.venv-sglang`` (its contract decoder
  ``api_types.GenerateRequest``, then ``GenerateReqInput.normalize_batch_and_arguments`` and
  ``srt.sampling.SamplingParams`` ``__init__`` / ``normalize`` / ``verify`` with the fixture's
  tokenizer) and by our server's ``GenerateApi.parse``, and the normalised meanings compared; bodies
  SGLang refuses are refused by both. Stop strings: SGLang's own ``Req._check_str_based_finish``
  and ``DetokenizerManager.trim_matched_stop`` replayed over our server's tokens give the same
  finish, ``output_ids`` and ``text``.
- ordinary tests against the embedded server with the tiny fixture model: stop-string matching,
  trimming and ``no_stop_trim``, prefill-only requests, ``min_new_tokens`` / ``ignore_eos``,
  ``input_token_logprobs`` against a reference forward, ``e2e_latency``, ``/get_server_info``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from tests.support.sglang_ref import needs_sglang, run_sglang

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_SEQ_LEN = 256


@contextlib.asynccontextmanager
async def running(model_dir, deterministic: bool = False):
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", 4, MAX_SEQ_LEN, deterministic=deterministic)
    server = InferenceServer(engine, tokenizer, str(model_dir))
    async with serve(server) as url, aiohttp.ClientSession() as http:
        async def post(body: dict) -> tuple[int, dict]:
            async with http.post(url + "/generate", json=body) as resp:
                return resp.status, await resp.json()

        async def get(path: str) -> tuple[int, dict]:
            async with http.get(url + path) as resp:
                return resp.status, await resp.json()

        yield post, get


def generate(model_dir, *bodies: dict, deterministic: bool = False) -> list[tuple[int, dict]]:
    """POST each body in turn to a fresh embedded server; their (status, answer)s."""
    async def main():
        async with running(model_dir, deterministic) as (post, _):
            return [await post(b) for b in bodies]

    return asyncio.run(main())


def prompt_ids(model_dir) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok("Natalia sold clips to 48 of her friends in April, and then", add_special_tokens=False)["input_ids"]


def reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V] float32``: the HF model's logits at every position (the reference forward)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# seeded sampling: the tiny random model's greedy output repeats one token
SAMPLED = {"temperature": 1.0, "sampling_seed": 11, "max_new_tokens": 24, "ignore_eos": True}


def first_stop(tok, output_ids: list[int], stop: str) -> int | None:
    """How many tokens SGLang keeps for ``stop`` (hand-written from ``Req.tail_str``: after each
    token, decode the last ``len(encode(stop)) + 1`` tokens and look for ``stop``), or ``None``."""
    window = len(tok.encode(stop, add_special_tokens=False)) + 1
    for n in range(1, len(output_ids) + 1):
        if stop in tok.decode(output_ids[:n][-window:]):
            return n
    return None


def mid_token_stop(tok, output_ids: list[int]) -> tuple[str, int]:
    """A stop string that ends inside a token of ``output_ids`` (the last characters of that
    token cut off), chosen so that it first occurs there; and that token's count (1-based)."""
    for k in range(2, len(output_ids)):
        piece = tok.decode(output_ids[k : k + 1])
        if len(piece) >= 2 and "\ufffd" not in piece:
            stop = tok.decode(output_ids[k - 1 : k]) + piece[:-1]
            if first_stop(tok, output_ids, stop) == k + 1 and stop not in tok.decode(output_ids[:k]):
                return stop, k + 1
    raise AssertionError(f"no token of {output_ids} suits a mid-token stop string")


# ---- stop strings ---------------------------------------------------------------------------------


def test_a_stop_string_ending_mid_token_keeps_that_token_and_is_trimmed_from_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    [(_, full)] = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": SAMPLED})
    stop, kept = mid_token_stop(tok, full["output_ids"])
    body = {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop": stop}, "return_logprob": True}
    body_list = {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop": ["never-said", stop]}}
    keep = {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop": [stop], "no_stop_trim": True}}
    (s1, trimmed), (s2, listed), (s3, kept_text) = generate(tiny_model_dir, body, body_list, keep)
    assert s1 == s2 == s3 == 200, (trimmed, listed, kept_text)
    whole = tok.decode(full["output_ids"][:kept])  # the text through the token completing the stop
    pos = whole.find(stop)
    for out in (trimmed, listed, kept_text):
        # SGLang: every token through the one completing the match, whole; matched is the string
        assert out["output_ids"] == full["output_ids"][:kept]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["meta_info"]["completion_tokens"] == kept
    # log-probs stay one per kept token, equal to the unstopped run's
    assert [e[1] for e in trimmed["meta_info"]["output_token_logprobs"]] == trimmed["output_ids"]
    assert trimmed["text"] == listed["text"] == whole[:pos]  # trimmed at the first occurrence
    assert kept_text["text"] == whole[: pos + len(stop)]  # no_stop_trim: through the stop, not the token's rest
    assert kept_text["text"] != whole  # the stop does end inside the token


def test_stop_strings_are_matched_on_the_decoded_tail_only(tiny_model_dir):
    # a stop string the output never contains changes nothing; one in the prompt does not match
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    in_prompt = tok.decode(prompt[:3])
    (_, full), (_, same) = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": SAMPLED},
                                    {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop": "\u2603 never"}})
    assert in_prompt not in full["text"]
    (_, not_prompt), = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop": in_prompt}})
    assert same["output_ids"] == not_prompt["output_ids"] == full["output_ids"]
    assert same["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_stop_strings_replay_in_deterministic_mode(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    sampled = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 7}
    [(_, full)] = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": sampled}, deterministic=True)
    stop, kept = mid_token_stop(tok, full["output_ids"])
    body = {"input_ids": [prompt] * 3, "sampling_params": {**sampled, "stop": stop}}
    runs = [generate(tiny_model_dir, body, deterministic=True)[0][1] for _ in range(2)]
    # three copies of one seeded prompt share each step: the same tokens, stop and text each time
    seen = [[(r["output_ids"], r["text"], r["meta_info"]["finish_reason"]) for r in run] for run in runs]
    expected = (full["output_ids"][:kept], tok.decode(full["output_ids"][:kept]).split(stop)[0],
                {"type": "stop", "matched": stop})
    assert seen[0] == seen[1] == [expected] * 3


# ---- stop tokens, ignore_eos, min_new_tokens ------------------------------------------------------


def test_ignore_eos_turns_stop_token_ids_off_and_a_stop_token_is_trimmed_from_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    [(_, full)] = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": SAMPLED})
    ids = full["output_ids"]
    stop_id = next(t for t in ids[2:] if tok.decode([t]).strip())  # a token with visible text
    at = ids.index(stop_id) + 1
    plain = {k: v for k, v in SAMPLED.items() if k != "ignore_eos"}
    (_, ignored), (_, stopped), (_, untrimmed) = generate(
        tiny_model_dir,
        {"input_ids": prompt, "sampling_params": {**SAMPLED, "stop_token_ids": [stop_id]}},
        {"input_ids": prompt, "sampling_params": {**plain, "stop_token_ids": [stop_id]}},
        {"input_ids": prompt, "sampling_params": {**plain, "stop_token_ids": [stop_id], "no_stop_trim": True}})
    assert ignored["output_ids"] == ids and ignored["meta_info"]["finish_reason"]["type"] == "length"
    assert tok.eos_token_id not in ids[:at]  # so without ignore_eos only the stop id can end it early
    assert stopped["output_ids"] == untrimmed["output_ids"] == ids[:at]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert stopped["text"] == tok.decode(ids[: at - 1])  # SGLang's detokenizer drops the stop token
    assert untrimmed["text"] == tok.decode(ids[:at])


def test_min_new_tokens_keeps_stop_tokens_from_being_drawn(tiny_model_dir):
    # greedy: the first token is the argmax; made a stop token, it ends the request at once, unless
    # min_new_tokens bans it (and EOS) for the first m draws: then each of those is the argmax of
    # the logits with the stop ids at -inf, and its log-prob is still the unmasked log_softmax
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    plain = {"temperature": 0.0, "max_new_tokens": 12}
    [(_, free)] = generate(tiny_model_dir, {"input_ids": prompt, "sampling_params": plain})
    first = free["output_ids"][0]
    m = 4
    (_, at_once), (_, held) = generate(
        tiny_model_dir,
        {"input_ids": prompt, "sampling_params": {**plain, "stop_token_ids": [first]}},
        {"input_ids": prompt, "sampling_params": {**plain, "stop_token_ids": [first], "min_new_tokens": m},
         "return_logprob": True})
    assert at_once["output_ids"] == [first] and at_once["meta_info"]["finish_reason"]["matched"] == first
    out = held["output_ids"]
    banned = {first, tok.eos_token_id}
    assert len(out) > m and not banned & set(out[:m])
    logits = reference_logits(tiny_model_dir, prompt + out)[len(prompt) - 1 : -1]
    for i, token in enumerate(out):
        row = logits[i].clone()
        if i < m:
            row[list(banned)] = float("-inf")
        assert token == int(row.argmax()), i
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
    got = torch.tensor([e[0] for e in held["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


# ---- prefill only, input log-probs ----------------------------------------------------------------


def test_max_new_tokens_0_is_prefill_only_with_the_prompts_logprobs(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    (status, out), (_, bare) = generate(
        tiny_model_dir,
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert status == 200, out
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and bare["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None  # SGLang: the first is null
    # reference: log_softmax of the HF logits at position j - 1, gathered at prompt token j
    logits = reference_logits(tiny_model_dir, prompt)
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = torch.tensor([e[0] for e in entries[1:]])
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    assert "input_token_logprobs" not in bare["meta_info"]


def test_logprob_start_len_gives_input_logprobs_from_that_position(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    start = 5
    sampling = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    (_, out), (_, default) = generate(
        tiny_model_dir,
        {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": start,
         "return_text_in_logprobs": True},
        {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True})
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[start:] and entries[0][0] is None
    assert [e[2] for e in entries] == [tok.decode([t]) for t in prompt[start:]]
    logits = reference_logits(tiny_model_dir, prompt)
    full = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = torch.tensor([e[0] for e in entries[1:]])
    assert torch.allclose(got, full[start:], atol=1e-5, rtol=0), (got - full[start:]).abs().max()
    assert out["output_ids"] == default["output_ids"]
    assert default["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    assert [e[2] for e in out["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in out["output_ids"]]


def test_meta_info_has_e2e_latency_and_server_info_has_sglangs_keys(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir) as (post, get):
            await post({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}})
            return await post({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}), await get("/get_server_info")

    (status, out), (info_status, info) = asyncio.run(main())
    assert status == 200 and info_status == 200
    latency = out["meta_info"]["e2e_latency"]
    assert isinstance(latency, float) and 0 < latency < 60
    assert info["model_path"] == str(tiny_model_dir) and info["context_length"] == MAX_SEQ_LEN
    assert info["max_running_requests"] == 4 and info["max_total_num_tokens"] == 4 * MAX_SEQ_LEN
    # prompts of 4 and 2 tokens; the second shares [1, 2] with the first's cache entry, capped one
    # short of its prompt (its last token runs for the logits): 1 of 6 prompt tokens from the cache
    assert info["sglang_api_version"] == "0.5.23" and info["internal_states"] == [
        {"num_running_reqs": 0, "prompt_tokens_total": 6, "cached_tokens_total": 1, "cache_hit_rate": 1 / 6}]


# ---- what stays a 400 -----------------------------------------------------------------------------


@pytest.mark.parametrize("sampling, words", [
    ({"temprature": 1.0}, "unknown sampling_params field 'temprature'"),
    ({"n": 2}, "sampling_params.n=2 is not supported"),
    ({"regex": "[0-9]+"}, "sampling_params.regex='[0-9]+' is not supported"),
    ({"json_schema": "{}"}, "sampling_params.json_schema='{}' is not supported"),
    ({"stop_regex": "\\d"}, "sampling_params.stop_regex='\\\\d' is not supported"),
    ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty=0.5 is not supported"),
    ({"logit_bias": {"3": 1.0}}, "sampling_params.logit_bias={'3': 1.0} is not supported"),
    ({"max_new_tokens": "16"}, "sampling_params.max_new_tokens '16' has the wrong JSON type"),
    ({"stop": [1]}, "sampling_params.stop [1] has the wrong JSON type"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens 9 is not in [0, max_new_tokens (8)]"),
])
def test_unknown_and_unsupported_sampling_fields_are_a_400_naming_them(tiny_model_dir, sampling, words):
    [(status, out)] = generate(tiny_model_dir, {"input_ids": [1, 2], "sampling_params": sampling})
    assert status == 400 and words in out["error"]["message"], out


@pytest.mark.parametrize("body, words", [
    ({"return_logprob": True, "logprob_start_len": 2}, "logprob_start_len 2 is not below the prompt's 2 tokens"),
    ({"top_logprobs_num": 3}, "top_logprobs_num 3 is not supported"),
    ({"return_hidden_states": True}, "return_hidden_states is not supported"),
    ({"logprob_start_len": "0"}, "logprob_start_len '0' is not an integer"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params has 1 objects for a batch of 2"),
])
def test_unsupported_top_level_fields_are_a_400_naming_them(tiny_model_dir, body, words):
    [(status, out)] = generate(tiny_model_dir, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, **body})
    assert status == 400 and words in out["error"]["message"], out


# ---- against SGLang's own code ----------------------------------------------------------------------

# Runs in .venv-sglang. For each body: FastAPI's parse (pydantic over GenerateReqInput), the
# contract gate (api_types.GenerateRequest), normalize_batch_and_arguments, and per prompt
# srt SamplingParams(**) / normalize(tokenizer) / verify(vocab): refused, or its normalised meaning.
# For each stop case: SGLang's Req finish logic (update_finish_state and what it calls, bound to a
# stand-in request) replayed token by token over a token stream, and the detokenizer's
# trim_matched_stop (taken from detokenizer_manager.py's source: importing that module needs
# fastapi and setproctitle, which .venv-sglang does not hold).
_SGLANG_SIDE = r'''
import ast, json, sys, types, typing
import pydantic
from transformers import AutoTokenizer
from sglang.api.v1.api_types import GenerateRequest, JsonContractError
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers import schedule_batch
from sglang.srt.sampling.sampling_params import SamplingParams, TOP_K_ALL

job = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(job["tokenizer"])
tok.additional_stop_token_ids = None  # what SGLang's get_tokenizer adds to an HF tokenizer
vocab = job["vocab_size"]
adapter = pydantic.TypeAdapter(GenerateReqInput)

def meaning(sub):
    sp = SamplingParams(**(sub.sampling_params or {}))
    sp.normalize(tok)
    sp.verify(vocab)
    return {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_k": sp.top_k,
            "top_p": sp.top_p, "min_new_tokens": sp.min_new_tokens, "ignore_eos": sp.ignore_eos,
            "no_stop_trim": sp.no_stop_trim, "skip_special_tokens": sp.skip_special_tokens,
            "spaces_between_special_tokens": sp.spaces_between_special_tokens,
            "sampling_seed": sp.sampling_seed, "stop": list(sp.stop_strs),
            "stop_token_ids": sorted(sp.stop_token_ids or ()),
            "return_logprob": bool(sub.return_logprob), "logprob_start_len": sub.logprob_start_len,
            "return_text_in_logprobs": bool(sub.return_text_in_logprobs)}

decoded = []
for body in job["bodies"]:
    try:
        obj = adapter.validate_python(body)
        GenerateRequest.from_json_value(body)
        obj.normalize_batch_and_arguments()
        subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        decoded.append({"accepted": True, "prompts": [meaning(s) for s in subs]})
    except (pydantic.ValidationError, JsonContractError, ValueError, TypeError) as exc:
        decoded.append({"accepted": False, "error": f"{type(exc).__name__}: {exc}"[:300]})

Req = schedule_batch.Req
source = open(schedule_batch.__file__.replace("schedule_batch.py", "detokenizer_manager.py")).read()
trim_def = next(n for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == "DetokenizerManager"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "trim_matched_stop")
namespace = {"Union": typing.Union, "List": typing.List, "Dict": typing.Dict}
exec(compile(ast.Module([trim_def], []), "detokenizer_manager.py", "exec"), namespace)
detok = types.SimpleNamespace(is_tool_call_parser_gpt_oss=False, tool_close_token_ids=set())

replayed = []
for case in job["stop_cases"]:
    sp = SamplingParams(**case["sampling_params"])
    sp.normalize(tok)
    req = types.SimpleNamespace(sampling_params=sp, output_ids=[], tokenizer=tok, eos_token_ids={tok.eos_token_id},
                                vocab_size=vocab, decoded_text="", finished_reason=None, finished_len=None,
                                to_finish=None, grammar=None)
    for name in ("finished", "update_finish_state", "_check_vocab_boundary_finish", "_check_str_based_finish",
                 "_check_token_based_finish", "_cap_finished_len_at_max_new_tokens", "tail_str",
                 "_stop_match_tail_len", "_locate_str_stop_finished_len"):
        setattr(req, name, types.MethodType(getattr(Req, name), req))
    for token in case["stream"]:
        req.output_ids.append(token)
        req.update_finish_state(1)
        if req.finished():
            break
    kept = req.output_ids[: req.finished_len] if req.finished_len is not None else req.output_ids
    reason = req.finished_reason.to_json() if req.finished_reason is not None else None
    ids = namespace["trim_matched_stop"](detok, list(kept), reason, sp.no_stop_trim)
    text = tok.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    text = namespace["trim_matched_stop"](detok, text, reason, sp.no_stop_trim)
    replayed.append({"output_ids": kept, "finish_reason": reason, "text": text})

print(json.dumps({"decoded": decoded, "replayed": replayed}))
'''


def _bodies(p: list[int], q: list[int]) -> tuple[list[dict], list[dict], list[dict]]:
    """(accepted by both with one meaning, refused by both, accepted by SGLang and refused here by
    design) ``/generate`` bodies over prompts ``p`` and ``q``."""
    same = [
        {"input_ids": p, "sampling_params": {"max_new_tokens": 8, "stop_token_ids": None}},  # slime's default
        {"input_ids": p, "sampling_params": {"max_new_tokens": 8, "stop_regex": []}},  # SGLang's frontend sgl.gen
        {"input_ids": p, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
         "logprob_start_len": 0},  # the frontend's select / cache_prefix
        {"input_ids": p, "sampling_params": {"stop": ["\n"], "max_new_tokens": 16}},  # slime --rollout-stop
        {"input_ids": p, "sampling_params": {"stop": "\n", "max_new_tokens": 16}},  # AReaL's stop
        {"input_ids": p, "sampling_params": {"stop": None, "stop_token_ids": [], "stop_regex": None}},
        {"input_ids": p, "sampling_params": {"stop": ["a", "b", "a"], "stop_token_ids": [5, 5, 3]}},
        {"input_ids": p, "sampling_params": {"ignore_eos": True, "min_new_tokens": 2, "max_new_tokens": 8,
                                             "no_stop_trim": True, "skip_special_tokens": False,
                                             "spaces_between_special_tokens": False}},
        {"input_ids": p, "sampling_params": {"temperature": 0}},
        {"input_ids": p, "sampling_params": {"temperature": 5e-7, "top_k": -1}},
        {"input_ids": p, "sampling_params": {"temperature": 1, "top_k": None, "top_p": None}},
        {"input_ids": p, "sampling_params": {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "sampling_seed": 42}},
        {"input_ids": p, "sampling_params": {"max_new_tokens": None}},
        {"input_ids": p, "sampling_params": None},
        {"input_ids": p},
        {"input_ids": p, "sampling_params": {"min_p": 0.0, "frequency_penalty": 0, "presence_penalty": 0.0,
                                             "repetition_penalty": 1, "n": 1, "json_schema": None, "regex": "",
                                             "ebnf": None, "logit_bias": {}, "custom_params": None,
                                             "stream_interval": 1, "beam_width": None}},
        {"input_ids": p, "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 3,
         "top_logprobs_num": 0, "stream": False, "an_unknown_top_level_key": 1},
        {"input_ids": [p, q], "rid": ["a", "b"], "return_logprob": [True, False], "logprob_start_len": [0, -1],
         "sampling_params": [{"max_new_tokens": 4, "stop": "x"}, {"max_new_tokens": 6, "temperature": 0}]},
        {"input_ids": [p, q], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True},
    ]
    refused = [
        {"input_ids": p, "sampling_params": {"temprature": 1.0}},
        {"input_ids": p, "return_logprob": "false"},
        {"input_ids": p, "stream": "false"},
        {"input_ids": p, "logprob_start_len": "0"},
        {"input_ids": p, "sampling_params": {"max_new_tokens": "16"}},
        {"input_ids": p, "sampling_params": {"max_new_tokens": 1.5}},
        {"input_ids": p, "sampling_params": {"max_new_tokens": True}},
        {"input_ids": p, "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": p, "sampling_params": {"temperature": "0.5"}},
        {"input_ids": p, "sampling_params": {"temperature": -1.0}},
        {"input_ids": p, "sampling_params": {"top_p": 0}},
        {"input_ids": p, "sampling_params": {"top_k": 0}},
        {"input_ids": p, "sampling_params": {"ignore_eos": 1}},
        {"input_ids": p, "sampling_params": {"stop": 5}},
        {"input_ids": p, "sampling_params": {"stop": [1]}},
        {"input_ids": p, "sampling_params": {"stop": ["s"] * 33}},
        {"input_ids": p, "sampling_params": {"stop_token_ids": ["1"]}},
        {"input_ids": p, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 8}},
        {"input_ids": p, "sampling_params": {"sampling_seed": "7"}},
        {"input_ids": p, "sampling_params": {"choice": []}},  # schema field, not in SGLang's SamplingParams
    ]
    ours_only = [  # SGLang runs these; this server refuses them with a message naming the field
        ({"input_ids": p, "sampling_params": {"n": 2}}, "sampling_params.n=2"),
        ({"input_ids": p, "sampling_params": {"regex": "[0-9]+"}}, "sampling_params.regex"),
        ({"input_ids": p, "sampling_params": {"stop_regex": ["\\d"]}}, "sampling_params.stop_regex"),
        ({"input_ids": p, "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
        ({"input_ids": p, "sampling_params": {"stop": [""]}}, "empty string"),
        ({"input_ids": p, "top_logprobs_num": 2, "return_logprob": True}, "top_logprobs_num"),
    ]
    return same, refused, ours_only


def _our_meaning(call, max_seq_len: int) -> list[dict]:
    """Our decoded prompts in SGLang's normalised terms (greedy is temperature 1 with top_k 1,
    the whole vocabulary top_k ``1 << 30``, ``max_new_tokens: null`` ``None``)."""
    out = []
    for prompt in call.prompts:
        p = prompt.params
        rest = p.max_new_tokens == max_seq_len - len(prompt.input_ids) and p.max_new_tokens != 128
        out.append({
            "max_new_tokens": None if rest else p.max_new_tokens,
            "temperature": 1.0 if p.temperature == 0 else p.temperature,
            "top_k": 1 if p.temperature == 0 else (1 << 30 if p.top_k == -1 else p.top_k),
            "top_p": p.top_p, "min_new_tokens": p.min_new_tokens, "ignore_eos": p.ignore_eos,
            "no_stop_trim": p.no_stop_trim, "skip_special_tokens": p.skip_special_tokens,
            "spaces_between_special_tokens": p.spaces_between_special_tokens, "sampling_seed": p.sampling_seed,
            "stop": list(p.stop), "stop_token_ids": sorted(p.stop_token_ids),
            "return_logprob": prompt.return_logprob,
            "logprob_start_len": prompt.logprob_start_len,
            "return_text_in_logprobs": call.return_text_in_logprobs,
        })
    return out


@pytest.fixture(scope="module")
def sglang_side(tiny_model_dir):
    """Our server's decodings and generations, and SGLang's own code's verdict on the same bodies and
    token streams (one ``.venv-sglang`` process)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    p, q = prompt_ids(tiny_model_dir), prompt_ids(tiny_model_dir)[:7]
    same, refused, ours_only = _bodies(p, q)
    engine, _ = load_engine(str(tiny_model_dir), "float32", "cpu", 4, MAX_SEQ_LEN)
    server = InferenceServer(engine, tok, str(tiny_model_dir))

    def ours(body):
        try:
            return server.generation.parse(json.loads(json.dumps(body)))
        except ValueError as exc:
            return exc

    [(_, full)] = generate(tiny_model_dir, {"input_ids": p, "sampling_params": SAMPLED})
    stream = full["output_ids"]
    stop, _ = mid_token_stop(tok, stream)
    plain = {"temperature": 1.0, "sampling_seed": 11, "max_new_tokens": 24}
    cases = [
        {**SAMPLED, "stop": stop},
        {**SAMPLED, "stop": [stop], "no_stop_trim": True},
        {**SAMPLED, "stop": ["never said", stop]},
        {**plain, "stop_token_ids": [stream[5]]},
        {**plain, "stop_token_ids": [stream[5]], "no_stop_trim": True, "skip_special_tokens": False},
        {**SAMPLED, "stop_token_ids": [stream[5]]},  # ignore_eos: the stop id is ignored too
        {**plain, "stop_token_ids": [stream[4]], "stop": tok.decode(stream[4:5])},  # both in one token
    ]
    served = generate(tiny_model_dir, *({"input_ids": p, "sampling_params": c} for c in cases))
    job = {"tokenizer": str(tiny_model_dir), "vocab_size": engine.vocab_size,
           "bodies": same + refused + [b for b, _ in ours_only], "stop_cases": [
               {"sampling_params": c, "stream": stream} for c in cases]}
    theirs = run_sglang(_SGLANG_SIDE, job, timeout=240)
    decoded = theirs["decoded"]
    return {
        "same": list(zip(same, decoded[: len(same)], map(ours, same))),
        "refused": list(zip(refused, decoded[len(same) : len(same) + len(refused)], map(ours, refused))),
        "ours_only": list(zip(ours_only, decoded[len(same) + len(refused) :], (ours(b) for b, _ in ours_only))),
        "stops": list(zip(cases, theirs["replayed"], served)),
    }


@pytest.mark.sglang_ref
@needs_sglang
def test_bodies_sglang_accepts_have_the_same_meaning_here(sglang_side):
    for body, theirs, ours in sglang_side["same"]:
        assert theirs["accepted"], (body, theirs)
        assert not isinstance(ours, ValueError), (body, ours)
        assert _our_meaning(ours, MAX_SEQ_LEN) == theirs["prompts"], body


@pytest.mark.sglang_ref
@needs_sglang
def test_bodies_sglang_refuses_are_refused_here(sglang_side):
    for body, theirs, ours in sglang_side["refused"]:
        assert not theirs["accepted"], (body, theirs)
        assert isinstance(ours, ValueError), (body, ours)


@pytest.mark.sglang_ref
@needs_sglang
def test_what_sglang_runs_and_this_server_does_not_is_a_400_naming_the_field(sglang_side):
    for (body, words), theirs, ours in sglang_side["ours_only"]:
        assert theirs["accepted"], (body, theirs)  # else it belongs in the refused list
        assert isinstance(ours, ValueError) and words in str(ours), (body, ours)


@pytest.mark.sglang_ref
@needs_sglang
def test_stops_finish_keep_tokens_and_trim_text_as_sglangs_own_code(sglang_side):
    for sampling, theirs, (status, ours) in sglang_side["stops"]:
        assert status == 200, ours
        assert ours["output_ids"] == theirs["output_ids"], sampling
        reason = {k: v for k, v in theirs["finish_reason"].items() if v is not None}
        assert ours["meta_info"]["finish_reason"] == reason, sampling
        assert ours["text"] == theirs["text"], sampling
