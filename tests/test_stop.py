"""Stop strings however the model spells them, and streams that never send text the answer cuts.

- ``StopStrings.match`` with the fixture's byte-level BPE tokenizer on token sequences that spell
  a stop string canonically, one character a token, one byte a token, and mixed: each is found at
  the token that completes it, never before; and a SentencePiece-style tokenizer whose decoder
  drops the first token's space, which the window's extra token keeps.
- A tiny Llama whose greedy output is fixed (``chain_model_dir``: every layer adds zero, so the
  next token is a function of the current one, set in the embedding and LM head) spells
  ``OK answer.`` one character a token, then ends: ``/generate`` and ``/v1`` stop on ``" answer"``
  (5 tokens canonically, 7 as spelled), keep the sampled tokens and log-probs, and trim the text.
- Its streamed ``/generate`` chunks: each chunk's text is a prefix of the final text, whether the
  stop string's beginning is completed or not (then the held-back text is sent once it cannot be).
- SGLang 0.5.23's own finish check (``Req._check_str_based_finish``, marker ``sglang_ref``) misses
  the one-character-a-token spelling: the limitation this server does not share.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from areal_async.embedded.engine.stop import StopStrings
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from tests.support import openai_http
from tests.support.sglang_ref import needs_sglang, run_sglang

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPOKEN = "OK answer."  # what the chain model says, one character a token, then <|im_end|>


def single_char_ids(tok) -> dict[str, int]:
    """Each character that is one token: its id (a lone byte of a longer character, decoding to
    U+FFFD, left out)."""
    pieces = {tok.decode([i]): i for i in range(len(tok))}
    return {piece: i for piece, i in pieces.items() if len(piece) == 1 and piece != "\ufffd"}


def byte_ids(tok, text: str) -> list[int]:
    """``text`` spelled one UTF-8 byte a token (the byte-level alphabet has a token per byte; its
    pre-tokenizer writes each byte as that token's character)."""
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    ids = tok.convert_tokens_to_ids(list("".join(piece for piece, _ in pieces)))
    assert len(ids) == len(text.encode("utf-8")), (text, ids)
    return ids


# ---- the matcher --------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [" answer", "\u00bd answer"])
def test_a_stop_string_is_found_at_its_last_token_however_it_is_spelled(tiny_model_dir, stop):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chars = single_char_ids(tok)
    canonical = tok.encode(stop, add_special_tokens=False)
    # " answer" is 5 tokens canonically (" a", "n", "s", "w", "er"); "½ answer" 7 (½ is two bytes)
    spellings = {
        "canonical": canonical,
        "one byte a token": byte_ids(tok, stop),
        "one character a token": [i for c in stop for i in ([chars[c]] if c in chars else byte_ids(tok, c))],
        "mixed": byte_ids(tok, stop[:-3]) + tok.encode(stop[-3:], add_special_tokens=False),
    }
    assert len(spellings["one byte a token"]) == len(stop.encode("utf-8")) > len(canonical) + 1  # SGLang's window misses it
    before = tok.encode("Then the", add_special_tokens=False) + byte_ids(tok, "\u00bd")  # text, then a 2-byte character
    stops = StopStrings(("#!", stop), tok)  # a short first stop: the window is sized by the second
    for name, ids in spellings.items():
        assert tok.decode(ids) == stop, name
        output = before + ids
        found = [stops.match(output[:n]) for n in range(1, len(output) + 1)]
        assert found == [None] * (len(output) - 1) + [stop], name  # at the completing token, not before


def test_a_stop_string_beginning_inside_a_token_or_a_character_is_found(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chars = single_char_ids(tok)
    # "answer" after the token " a" (half outside the stop), then one character a token; then
    # "½answer" after "½½" one byte a token: the window begins inside the first "½" (decoded
    # as U+FFFD) and still holds the stop string whole
    output = tok.encode(" a", add_special_tokens=False) + [chars[c] for c in "nswer"]
    assert StopStrings(("answer",), tok).match(output) == "answer"
    output = byte_ids(tok, "\u00bd\u00bd") + [chars[c] for c in "answer"]
    assert StopStrings(("\u00bdanswer",), tok).match(output) == "\u00bdanswer"
    assert StopStrings(("\u00bd\u00bdanswer!",), tok).match(output) is None


def test_a_leading_space_is_kept_by_the_extra_token_of_the_window():
    # a SentencePiece-style tokenizer (Metaspace "▁", byte fallback) strips the space of the first
    # token it decodes: " answer" spelled "▁", "a", ... decodes alone as "answer", and only the
    # token before it (the window's + 1) keeps the space
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    sp.train_from_iterator(["OK the answer is here. The answer was given."] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    assert tok.convert_ids_to_tokens(tok.encode(" answer", add_special_tokens=False)) == ["\u2581answer"]
    spelled = tok.convert_tokens_to_ids(["O", "K", "\u2581", *"answer"])
    assert tok.decode(spelled) == "OK answer" and tok.decode(spelled[-7:]) == "answer"
    stops = StopStrings((" answer",), tok)
    assert stops.match(spelled) == " answer" and stops.match(spelled[:-1]) is None and stops.window == 8


# ---- the engine: a model whose greedy output is known ---------------------------------------------


@pytest.fixture(scope="module")
def chain_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny Llama (2 layers, hidden 64, untied LM head; the fixture tokenizer) whose greedy
    continuation of ``:`` is ``SPOKEN`` one character a token, then ``<|im_end|>``.

    Every layer's ``o_proj`` and ``down_proj`` are zero, so the last hidden state is the current
    token's embedding: the k-th token of the chain embeds as the unit vector e_k, and the LM head's
    row of the (k+1)-th is e_k. After the final RMSNorm, e_k is 8 e_k (RMS 1/8 over 64 dims), so
    the next token's logit is 8 and every other one 0: greedy follows the chain."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chars = single_char_ids(tok)
    chain = [chars[":"]] + [chars[c] for c in SPOKEN] + [tok.eos_token_id]
    assert len(set(chain)) == len(chain), "a token twice in the chain would need two successors"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[successor, k] = 1.0
    out = tmp_path_factory.mktemp("chain")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@contextlib.asynccontextmanager
async def running(model_dir):
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", 4, 64, prefix_cache=False)
    async with serve(InferenceServer(engine, tokenizer, str(model_dir))) as url, aiohttp.ClientSession() as http:
        yield url, http


async def post(http, url: str, body: dict) -> dict:
    status, answer = await openai_http.post(http, url, body)
    assert status == 200, answer
    return answer


async def chunks(http, url: str, body: dict) -> list[dict]:
    """A streamed answer's ``data:`` payloads, JSON-decoded (the last, ``[DONE]``, checked and dropped)."""
    return await openai_http.events(http, url, {**body, "stream": True})


def prompt(model_dir) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model_dir).encode("Say it:", add_special_tokens=False)
    assert ids[-1] == single_char_ids(AutoTokenizer.from_pretrained(model_dir))[":"]
    return ids


GREEDY = {"temperature": 0.0, "max_new_tokens": 16}


def test_generate_stops_on_a_stop_string_spelled_one_character_a_token(chain_model_dir):
    ids = prompt(chain_model_dir)

    async def main():
        async with running(chain_model_dir) as (url, http):
            body = {"input_ids": ids, "return_logprob": True}
            free = await post(http, url + "/generate", {**body, "sampling_params": GREEDY})
            stopped = await post(http, url + "/generate", {**body, "sampling_params": {**GREEDY, "stop": " answer"}})
            kept = await post(http, url + "/generate",
                              {**body, "sampling_params": {**GREEDY, "stop": [" answer"], "no_stop_trim": True}})
            v1 = await post(http, url + "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                            "stop": " answer"})
            v1_stream = await chunks(http, url + "/v1/completions", {"prompt": ids, "max_tokens": 16,
                                                                      "temperature": 0, "stop": " answer"})
            return free, stopped, kept, v1, v1_stream

    free, stopped, kept, v1, v1_stream = asyncio.run(main())
    tok = AutoTokenizer.from_pretrained(chain_model_dir)
    assert free["text"] == SPOKEN and len(free["output_ids"]) == len(SPOKEN) + 1  # one character a token, then EOS
    through = SPOKEN.index(" answer") + len(" answer")  # 9 tokens: "OK answer" (the stop's 7 of them)
    assert len(tok.encode(" answer", add_special_tokens=False)) + 1 < len(" answer")  # SGLang's window: 6 tokens
    for out in (stopped, kept):
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " answer"}
        # the sampled tokens and their log-probs, exactly: those of the run without a stop string
        assert out["output_ids"] == free["output_ids"][:through]
        assert out["meta_info"]["output_token_logprobs"] == free["meta_info"]["output_token_logprobs"][:through]
    assert stopped["text"] == "OK" and kept["text"] == "OK answer"
    choice = v1["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["matched_stop"]) == ("OK", "stop", " answer")
    assert v1["usage"]["completion_tokens"] == through
    assert "".join(c["choices"][0]["text"] for c in v1_stream if c["choices"]) == "OK"


@pytest.mark.parametrize("stop, texts", [
    # completed: "nswer" (4 tokens canonically, so SGLang's window sees it too) begins at "n";
    # from there the text is held back, and the answer is cut before it
    ("nswer", ["O", "OK", "OK ", "OK a"] + ["OK a"] * 5),
    # not completed: "answer!" begins at "a" and "." ends it: the held-back text goes out then
    ("answer!", ["O", "OK", "OK "] + ["OK "] * 6 + ["OK answer.", "OK answer."]),
])
def test_streamed_generate_chunks_are_prefixes_of_the_final_text(chain_model_dir, stop, texts):
    ids = prompt(chain_model_dir)
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "stop": stop}, "return_logprob": True}

    async def main():
        async with running(chain_model_dir) as (url, http):
            return await post(http, url + "/generate", body), await chunks(http, url + "/generate", body)

    plain, streamed = asyncio.run(main())
    final = streamed[-1]
    assert final["text"] == plain["text"] == texts[-1] and final["output_ids"] == plain["output_ids"]
    assert [c["text"] for c in streamed] == texts
    assert all(final["text"].startswith(c["text"]) for c in streamed)
    # the stream's shape is unchanged: one cumulative chunk per token, only the text held back
    assert [len(c["output_ids"]) for c in streamed] == list(range(1, len(plain["output_ids"]) + 1))
    assert [c["meta_info"]["finish_reason"] for c in streamed[:-1]] == [None] * (len(streamed) - 1)


# Runs in .venv-sglang: SGLang's SamplingParams.normalize sizes the window, and its Req's string
# finish check (bound to a stand-in request) runs after each token of the stream.
_SGLANG_STR_FINISH = r'''
import json, sys, types
from transformers import AutoTokenizer
from sglang.srt.managers import schedule_batch
from sglang.srt.sampling.sampling_params import SamplingParams

job = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(job["tokenizer"])
sp = SamplingParams(stop=job["stop"], max_new_tokens=64)
sp.normalize(tok)

def stopped_at(stream):
    req = types.SimpleNamespace(sampling_params=sp, output_ids=[], tokenizer=tok, decoded_text="",
                                finished_reason=None, finished_len=None)
    for name in ("_check_str_based_finish", "tail_str", "_stop_match_tail_len", "_locate_str_stop_finished_len"):
        setattr(req, name, types.MethodType(getattr(schedule_batch.Req, name), req))
    for token in stream:
        req.output_ids.append(token)
        if req._check_str_based_finish(1):
            return len(req.output_ids)
    return None

print(json.dumps({"stopped_at": [stopped_at(s) for s in job["streams"]], "window": sp.stop_str_max_len + 1}))
'''


@pytest.mark.sglang_ref
@needs_sglang
def test_sglangs_own_check_misses_the_spelling_this_server_stops_on(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chars = single_char_ids(tok)
    spelled = [chars[c] for c in SPOKEN]  # one character a token
    canonical = tok.encode(SPOKEN, add_special_tokens=False)
    theirs = run_sglang(_SGLANG_STR_FINISH, {"tokenizer": str(tiny_model_dir), "stop": [" answer"],
                                             "streams": [spelled, canonical]})
    ours = StopStrings((" answer",), tok)
    ours_at = [next((n for n in range(1, len(s) + 1) if ours.match(s[:n]) is not None), None)
               for s in (spelled, canonical)]
    # spelled, SGLang decodes 5 canonical tokens + 1 and never sees " answer"; this server 7 bytes + 1
    assert (theirs["window"], ours.window) == (6, 8)
    assert ours_at == [len("OK answer"), len(tok.encode("OK answer", add_special_tokens=False))]
    assert theirs["stopped_at"] == [None, ours_at[1]]  # spelled canonically, both stop at its last token
