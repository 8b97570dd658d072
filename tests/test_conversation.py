"""The token record of a multi-turn episode (``areal_async.rollout.conversation``).

Three chat templates: the tiny tokenizer's ChatML (``tests/support/models.py``), a Qwen3-shaped one
on the same tokenizer (``tests/support/chat_templates.py``: tool results grouped into one user turn,
reasoning dropped before the last user query), and SmolLM2's own (the built-in model's tokenizer,
skipped when that model was never fetched into the default cache). Turns are "sampled" here by
encoding an assistant text (+ the end-of-turn token when the turn ended on it), so a full render of
the same messages is the reference the record must equal token for token.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from areal_async.config import ModelConfig
from areal_async.rollout.conversation import Conversation, SampledTurn, cut_at_stop
from tests.support.chat_templates import QWEN_STYLE_TEMPLATE

FIRST = [{"role": "system", "content": "You count fruit."},
         {"role": "user", "content": "How many apples are left?"}]


@pytest.fixture(scope="module")
def chatml_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def qwen_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def smollm2_tok():
    from transformers import AutoTokenizer

    cfg = ModelConfig()  # the built-in SmolLM2, as areal_async.model.source caches it
    path = pathlib.Path(cfg.cache_dir).expanduser() / cfg.path
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{cfg.path} was never fetched into {path.parent} (it needs a download)")
    return AutoTokenizer.from_pretrained(path)


TEMPLATES = ["chatml_tok", "qwen_tok", "smollm2_tok"]


def sample(tok, text: str, ended: bool = True, version: int = 3) -> SampledTurn:
    """A turn as the engine would return it: ``text``'s ids, plus the end-of-turn token when the
    turn ended on it (not when it stopped on a stop string); log-probs -0.1, -0.2, ..."""
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if ended else [])
    return SampledTurn(ids, [-0.1 * (k + 1) for k in range(len(ids))], [version] * len(ids), text)


def rendered(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("tok_name", TEMPLATES)
def test_render_parity_with_the_template(tok_name, request):
    """Stopped on a stop string (no end token sampled), one tool result, two consecutive tool
    results, a user turn: after every step the record is the template's full rendering with the
    generation prompt, and every sampled span follows a generation prompt."""
    tok = request.getfixturevalue(tok_name)
    conv = Conversation(tok, FIRST)
    assert conv.ids == rendered(tok, FIRST) and conv.prompt_len == len(conv.ids)
    turns = [
        (sample(tok, "I will count. <tool_call>count apples</tool_call>", ended=False),
         [{"role": "tool", "content": "3"}]),
        (sample(tok, "Two more calls.\n<tool_call>count pears</tool_call>"),
         [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5 pears"}]),
        (sample(tok, "The answer is 12."), [{"role": "user", "content": "Now double it."}]),
    ]
    gen_prompt = rendered(tok, FIRST)[len(tok.apply_chat_template(FIRST, tokenize=True, return_dict=False)):]
    assert gen_prompt  # "<|im_start|>assistant\n"
    for turn, new in turns:
        conv.add_sampled(*turn)
        added = conv.add_messages(new)
        assert conv.ids == rendered(tok, conv.messages)
        assert conv.ids[len(conv.ids) - len(added):] == added and added[-len(gen_prompt):] == gen_prompt
    conv.add_sampled(*sample(tok, "It is 24."))
    for start, _ in conv.turn_spans:
        before = conv.ids[:conv.prompt_len + start]
        assert before[-len(gen_prompt):] == gen_prompt
    assert [e - s for s, e in conv.turn_spans] == [len(t.ids) for t, _ in turns] + [len(sample(tok, "It is 24.").ids)]


def test_the_tool_separator_follows_a_sampled_end_token(chatml_tok):
    """ChatML: a turn that sampled ``<|im_end|>`` gets only the ``\\n`` after it; one that stopped
    on a stop string gets ``<|im_end|>\\n`` whole."""
    tok = chatml_tok
    end, nl = tok.eos_token_id, tok.encode("\n", add_special_tokens=False)
    tool = [{"role": "tool", "content": "3"}]
    tool_turn = tok.encode("<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    conv = Conversation(tok, FIRST)
    conv.add_sampled(*sample(tok, "Counting.", ended=True))
    assert conv.add_messages(tool) == nl + tool_turn
    conv.add_sampled(*sample(tok, "<tool_call>x</tool_call>", ended=False))
    assert conv.add_messages(tool) == [end] + nl + tool_turn


def test_earlier_reasoning_is_kept_as_sampled_when_the_template_strips_it(qwen_tok):
    tok = qwen_tok
    thought = "<think>\nThree left after two were eaten.\n</think>\n\nThere are 3."
    turn = sample(tok, thought)
    conv = Conversation(tok, FIRST)
    conv.add_sampled(*turn)
    asked = [{"role": "user", "content": "And pears?"}]
    conv.add_messages(asked)
    (start, end), = conv.turn_spans
    assert conv.ids[conv.prompt_len + start:conv.prompt_len + end] == turn.ids
    # the template's own rendering drops the reasoning: the record intentionally differs from it
    full = rendered(tok, conv.messages)
    assert full != conv.ids and tok.decode(full).count("<think>") == 0
    assert not any(full[k:k + len(turn.ids)] == turn.ids for k in range(len(full)))
    assert tok.decode(conv.ids).count("Three left after two were eaten.") == 1
    # a caller that strips the reasoning from its history starts a new sample
    stripped = FIRST + [{"role": "assistant", "content": "There are 3."}] + asked
    assert conv.extension(stripped) is None
    conv.add_sampled(*sample(tok, "Two pears."))
    pears = [{"role": "assistant", "content": "Two pears."}]
    same = FIRST + [{"role": "assistant", "content": thought}] + asked + pears
    new = [{"role": "user", "content": "Thanks."}]
    assert conv.extension(same + new) == new
    assert conv.extension(stripped + pears + new) is None


def test_sampled_ids_and_per_token_fields_are_kept_token_for_token(chatml_tok):
    """Turns given as ids the tokenizer would never produce for their text (one character per
    token) are kept exactly; mask, log-probs and versions line up with them."""
    tok = chatml_tok
    conv = Conversation(tok, FIRST)
    turns = []
    for k, text in enumerate(["Apples: three.", "<tool_call>eat</tool_call>", "Done."]):
        ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
        assert ids[:-1] != tok.encode(text, add_special_tokens=False)  # not the canonical encoding
        turns.append(SampledTurn(ids, [-(k + 1) - j / 100 for j in range(len(ids))], [7 + k] * len(ids), text))
    added = []
    for k, turn in enumerate(turns):
        conv.add_sampled(*turn)
        if k < len(turns) - 1:
            added.append(conv.add_messages([{"role": "tool", "content": f"result {k}"}]))
    out, mask, lp, ver, spans = (conv.ids[conv.prompt_len:], conv.loss_mask, conv.behav_logprobs, conv.versions,
                                 conv.turn_spans)
    assert (mask.dtype, lp.dtype, ver.dtype, spans.dtype) == (np.uint8, np.float32, np.int32, np.int32)
    assert len(out) == len(mask) == len(lp) == len(ver) == len(conv.output_ids)
    assert spans.shape == (3, 2)
    expect_mask = np.zeros(len(out), np.uint8)
    for (s, e), turn in zip(spans, turns):
        assert out[s:e] == turn.ids
        np.testing.assert_array_equal(lp[s:e], np.float32(turn.logprobs))
        np.testing.assert_array_equal(ver[s:e], turn.versions)
        expect_mask[s:e] = 1
    np.testing.assert_array_equal(mask, expect_mask)
    assert (lp[mask == 0] == 0).all() and (ver[mask == 0] == -1).all()
    for k, ids in enumerate(added):  # what lies between two turns is exactly what add_messages returned
        assert out[spans[k][1]:spans[k + 1][0]] == ids


def test_text_after_a_tool_end_tag_is_never_in_the_ids(chatml_tok):
    tok = chatml_tok
    said = "Let me look. <tool_call>count apples</tool_call>\nThe tool says 99 apples."
    ids = tok.encode(said, add_special_tokens=False)
    cut = cut_at_stop(ids, [-0.5] * len(ids), [2] * len(ids), tok.decode, ["</tool_call>", "<never>"])
    assert cut.ids == ids[:len(cut.ids)] and len(cut.ids) < len(ids)  # a prefix of what was sampled
    assert "</tool_call>" in tok.decode(cut.ids) and "</tool_call>" not in tok.decode(cut.ids[:-1])
    assert cut.text == tok.decode(cut.ids) and len(cut.logprobs) == len(cut.versions) == len(cut.ids)
    conv = Conversation(tok, FIRST)
    conv.add_sampled(*cut)
    conv.add_messages([{"role": "tool", "content": "3"}])
    assert "99" not in tok.decode(conv.ids) and "The tool says" not in tok.decode(conv.ids)
    assert conv.ids == rendered(tok, conv.messages)
    assert cut_at_stop(ids, [0.0] * len(ids), [0] * len(ids), tok.decode, ["<never>"]).ids == ids


def test_extension_compares_messages_field_by_field(chatml_tok):
    tok = chatml_tok
    conv = Conversation(tok, FIRST)
    new = [{"role": "user", "content": "More?"}]
    assert conv.extension(FIRST) == [] and conv.extension(FIRST + new) is None  # nothing sampled yet
    conv.add_sampled(*sample(tok, "Three."))
    parts = [{"type": "text", "text": "Three."}]
    given = [dict(m, name=None) for m in FIRST] + [{"role": "assistant", "content": parts, "tool_calls": None}]
    assert conv.extension(given + new) == new  # None-valued keys and text parts compare equal
    assert conv.extension(FIRST + [{"role": "assistant", "content": "Three!"}] + new) is None
    assert conv.extension(FIRST[1:] + [{"role": "assistant", "content": "Three."}] + new) is None
    assert conv.extension(FIRST + [{"role": "assistant", "content": "Three.", "reasoning_content": "x"}]) is None
    conv.add_ids(tok.encode("<|im_start|>user\nok<|im_end|>\n", add_special_tokens=False))
    assert conv.extension(FIRST + [{"role": "assistant", "content": "Three."}]) is None


def test_bad_input_raises_naming_the_values(chatml_tok):
    tok = chatml_tok
    conv = Conversation(tok, FIRST)
    with pytest.raises(ValueError, match=r"len\(ids\)=3, len\(logprobs\)=2, len\(versions\)=3"):
        conv.add_sampled([5, 6, 7], [-0.1, -0.2], [1, 1, 1], "abc")
    with pytest.raises(ValueError, match=r"len\(ids\)=2, len\(logprobs\)=2, len\(versions\)=1"):
        cut_at_stop([5, 6], [-0.1, -0.2], [1], tok.decode, ["x"])
    with pytest.raises(ValueError, match="follows a sampled turn.*prompt"):
        conv.add_messages([{"role": "user", "content": "hi"}])
    assert conv.ids == rendered(tok, FIRST) and len(conv.loss_mask) == 0 and conv.messages == FIRST


def test_given_prompt_ids_are_used_as_is(chatml_tok):
    tok = chatml_tok
    given = [tok.bos_token_id] + rendered(tok, FIRST)
    conv = Conversation(tok, FIRST, prompt_ids=given)
    conv.add_sampled(*sample(tok, "Three."))
    conv.add_messages([{"role": "user", "content": "More?"}])
    assert conv.ids[:len(given)] == given and conv.prompt_len == len(given)
    assert conv.ids[1:] == rendered(tok, conv.messages)


def test_template_arguments_reach_every_rendering(qwen_tok):
    """``enable_thinking=False`` puts an empty think block in the prompt's and every later
    generation prompt. (A full re-render drops the earlier one, which the engine was given.)"""
    tok, kw = qwen_tok, {"enable_thinking": False}
    conv = Conversation(tok, FIRST, chat_template_kwargs=kw)
    assert conv.ids == list(tok.apply_chat_template(FIRST, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False, **kw))
    assert tok.decode(conv.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    turn = sample(tok, "<tool_call>count</tool_call>", ended=False)
    conv.add_sampled(*turn)
    added = conv.add_messages([{"role": "tool", "content": "3"}])
    assert tok.decode(added) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert conv.ids == conv.ids[:conv.prompt_len] + turn.ids + added
