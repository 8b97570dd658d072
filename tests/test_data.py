"""GSM8K loading, prompt building and filtering, and the deterministic group → prompt map."""

from __future__ import annotations

import json

import numpy as np
import pytest

from areal_async.config import DataConfig
from areal_async.data import TASKS, PromptSet, load_task
from areal_async.data.gsm8k import read_gsm8k
from areal_async.data.task import BOXED_INSTRUCTION, build_messages

GOOD = json.dumps({"question": "What is 2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"})


@pytest.mark.parametrize("bad,why", [
    ("{not json", "not valid JSON"),
    (json.dumps({"question": "q"}), "'answer'"),
    (json.dumps({"question": "q", "answer": "no marker"}), "####"),
    (json.dumps({"question": "q", "answer": "#### four"}), "not a number"),
    (json.dumps([1, 2]), "JSON object"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([GOOD, "", bad, GOOD]) + "\n")  # the bad line is line 3
    with pytest.raises(ValueError, match=rf"train\.jsonl:3: malformed GSM8K line: .*{why}"):
        read_gsm8k(path)


def test_gold_is_the_number_after_hashes_without_commas(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"question": "q1", "answer": "a #### 1,000"}, {"question": "q2", "answer": "#### -3.5"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [x.gold for x in read_gsm8k(path)] == ["1000", "-3.5"]


def test_vendored_gsm8k_and_few_shot():
    train = load_task(DataConfig(), "train")
    test = load_task(DataConfig(), "test")
    assert (len(train), len(test)) == (7473, 1319)
    assert train.gold(0) == "72" and train.reward_fn == "math"
    msgs = train.messages(0)
    assert msgs == build_messages(train.items[0].question)
    assert msgs[-1]["content"].endswith(BOXED_INSTRUCTION)

    shot = load_task(DataConfig(few_shot=2), "train")
    assert len(shot) == 7471 and shot.gold(0) == train.gold(2)  # demos leave the train split
    turns = shot.messages(0)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert turns[1]["content"].endswith("The final answer is \\boxed{72}.")
    assert "<<" not in turns[1]["content"]
    assert load_task(DataConfig(few_shot=2), "test").messages(5)[:4] == turns[:4]
    with pytest.raises(ValueError, match="registered task"):
        load_task(DataConfig(task="nope"), "train")
    assert TASKS["gsm8k"] is not None


class ListTask:
    """A minimal Task: question i is ``"word " * sizes[i]``."""

    name = "list"
    reward_fn = "math"

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def messages(self, i):
        return [{"role": "user", "content": "clips " * self.sizes[i]}]

    def gold(self, i):
        return str(i)


def test_long_prompts_are_filtered_and_counted(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = ListTask([1, 200, 2, 3, 300])
    lengths = [len(tok(tok.apply_chat_template(task.messages(i), tokenize=False,
                                               add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]) for i in range(5)]
    limit = max(lengths[0], lengths[2], lengths[3])
    assert lengths[1] > limit and lengths[4] > limit
    ps = PromptSet(task, tok, max_prompt_len=limit, seed=0)
    assert (len(ps), ps.num_filtered, ps.num_total) == (3, 2, 5)
    assert [ps.at(j).data_index for j in range(3)] == [0, 2, 3]
    assert all(len(ps.for_group(g).prompt_ids) <= limit for g in range(12))
    assert "2 longer than max_prompt_len" in ps.summary()
    assert ps.at(1).prompt_ids == tok(tok.apply_chat_template(
        task.messages(2), tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="max_prompt_len"):
        PromptSet(ListTask([200, 300]), tok, max_prompt_len=limit, seed=0)


def test_group_to_prompt_map_is_a_seeded_permutation_per_epoch(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = ListTask(list(range(1, 8)))  # N = 7
    a, b = PromptSet(task, tok, 512, seed=5), PromptSet(task, tok, 512, seed=5)
    order = [a.for_group(g).data_index for g in range(21)]
    # Same seed, another process-like instance, groups visited in another order: same map.
    assert order == [b.for_group(g).data_index for g in reversed(range(21))][::-1]
    for epoch in range(3):  # every epoch visits each prompt exactly once, in its own order
        chunk = order[7 * epoch: 7 * (epoch + 1)]
        expected = np.random.default_rng([5, epoch]).permutation(7).tolist()
        assert chunk == expected
    assert order[:7] != order[7:14]
    other = PromptSet(task, tok, 512, seed=6)
    assert [other.for_group(g).data_index for g in range(7)] != order[:7]
    assert a.for_group(3).gold == str(order[3])
