"""The ``file`` task: your rows from JSONL or Parquet, field names from the config, every bad row
an error naming the file, the line (or row) and the field; nothing dropped."""

from __future__ import annotations

import json

import pytest

from areal_async.config import DataConfig, load_config
from areal_async.data import TASKS, PromptSet, load_task
from areal_async.data.file import parse_row

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "level": 1, "tags": ["easy"]},
    {"prompt": "What is 3*3?", "answer": 9, "level": 2, "meta": {"src": "x"}},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist takes the first row's
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), path)
    return str(path)


def file_task(path, split="train", **keys):
    return load_task(DataConfig(task="file", **{f"{split}_path": path}, **keys), split)


def test_prompt_rows_become_user_turns_and_every_field_passes_through(tmp_path):
    task = file_task(write_jsonl(tmp_path / "t.jsonl", ["", *ROWS]))  # a blank line is no row
    assert TASKS["file"] is not None and task.name == "file" and task.reward_fn == "math"
    assert len(task) == 2
    assert task.messages(0) == [{"role": "user", "content": "What is 2+2?"}]
    assert [task.gold(0), task.gold(1)] == ["4", "9"]  # a number is read as its decimal text
    assert task.item(1).row == ROWS[1]  # the row as read: every field, original names
    assert task.item(1).source == f"{tmp_path / 't.jsonl'}:3"


def test_messages_rows_renamed_fields_and_a_system_prompt(tmp_path):
    rows = [{"conv": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "2+2?"}], "gold": "4"},
            {"q": "3+3?", "gold": 6.5}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    task = file_task(path, messages_key="conv", prompt_key="q", answer_key="gold",
                     system_prompt="Box it.")
    assert task.messages(0) == [{"role": "system", "content": "Box it."}] + rows[0]["conv"]
    assert task.messages(1) == [{"role": "system", "content": "Box it."},
                                {"role": "user", "content": "3+3?"}]
    assert [task.gold(0), task.gold(1)] == ["4", "6.5"]
    task.messages(0)[1]["content"] = "edited"  # callers get copies: the items stay as read
    assert task.messages(0)[2]["content"] == "Hello"


def test_parquet_in_verl_shape_prompt_as_messages_and_a_nested_answer(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{k}+1?"}], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": str(k + 1)}} for k in range(3)]
    task = file_task(write_parquet(tmp_path / "t.parquet", rows), answer_key="reward_model.ground_truth")
    assert [task.messages(k) for k in range(3)] == [r["prompt"] for r in rows]
    assert [task.gold(k) for k in range(3)] == ["1", "2", "3"]
    assert task.item(2).row == rows[2] and task.item(2).source.endswith("t.parquet row 3")


def test_parquet_and_jsonl_give_the_same_task(tmp_path):
    rows = [{"prompt": "a?", "answer": "1", "n": 1}, {"messages": [{"role": "user", "content": "b?"}],
                                                       "answer": "2", "n": 2}]
    a = file_task(write_jsonl(tmp_path / "t.jsonl", rows))
    b = file_task(write_parquet(tmp_path / "t.parquet", rows))
    for k in range(2):
        assert (a.messages(k), a.gold(k)) == (b.messages(k), b.gold(k))
        # Parquet gives every row every column: the absent one is null, which counts as absent
        assert {key: v for key, v in b.item(k).row.items() if v is not None} == a.item(k).row


def test_rows_without_an_answer(tmp_path):
    task = file_task(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "write a poem"}]), answer_key="")
    assert task.gold(0) == ""


MSG = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("bad,why", [
    ("{not json", r"not valid JSON \(.* at column 2\)"),
    ("[1, 2]", "expected a JSON object .*got a list"),
    (json.dumps({"question": "q", "answer": "1"}),
     "no 'prompt' or 'messages' field \\(the row's fields: 'answer', 'question'\\); name .*data.prompt_key"),
    (json.dumps({"prompt": "q", "messages": MSG, "answer": "1"}), "both 'prompt' and 'messages'"),
    (json.dumps({"prompt": 7, "answer": "1"}), "field 'prompt' is a number, not a string or a list"),
    (json.dumps({"prompt": "  ", "answer": "1"}), "field 'prompt' is empty"),
    (json.dumps({"messages": "hi", "answer": "1"}), "field 'messages' is a string, not a non-empty list"),
    (json.dumps({"messages": [], "answer": "1"}), "field 'messages' is a list, not a non-empty list"),
    (json.dumps({"messages": ["hi"], "answer": "1"}), "field 'messages', message 1 is a string"),
    (json.dumps({"messages": [{"role": "user"}], "answer": "1"}),
     "field 'messages', message 1: 'content' is missing, not a string"),
    (json.dumps({"messages": MSG + [{"role": "assistant", "content": "a"}], "answer": "1"}),
     "field 'messages': the last message is the assistant's"),
    (json.dumps({"prompt": "q"}), "no 'answer' field .*data.answer_key=''"),
    (json.dumps({"prompt": "q", "answer": None}), "field 'answer' is null"),
    (json.dumps({"prompt": "q", "answer": ["1"]}), "field 'answer' is a list; .*string or a number"),
    (json.dumps({"prompt": "q", "answer": True}), "field 'answer' is a boolean"),
    (json.dumps({"prompt": "q", "answer": ""}), "field 'answer' is an empty string"),
])
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, bad, why):
    good = json.dumps({"prompt": "q", "answer": "1"})
    path = write_jsonl(tmp_path / "train.jsonl", [good, "", bad, good])  # the bad row is line 3
    with pytest.raises(ValueError, match=rf"train\.jsonl:3: malformed row \(data\.train_path\): {why}"):
        file_task(path)


def test_bad_bytes_a_bad_parquet_row_and_a_bad_parquet_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "q", "answer": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl:2: malformed row .*not UTF-8 text"):
        file_task(str(path))
    rows = [{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": None}]
    with pytest.raises(ValueError, match=r"t\.parquet row 2: malformed row .*field 'answer' is null"):
        file_task(write_parquet(tmp_path / "t.parquet", rows))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet is not a Parquet file pyarrow can read"):
        file_task(str(tmp_path / "junk.parquet"))


def test_a_blank_file_an_empty_one_and_a_missing_one(tmp_path):
    (tmp_path / "test.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"data\.test_path=.*test\.jsonl holds no rows \(blank lines only\)"):
        file_task(str(tmp_path / "test.jsonl"), split="test")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no rows \(the file is empty\)"):
        file_task(str(tmp_path / "empty.jsonl"), split="test")
    with pytest.raises(FileNotFoundError, match="nosuch.jsonl"):
        file_task(str(tmp_path / "nosuch.jsonl"))


def test_a_byte_order_mark_at_the_start_is_read_past_and_one_later_is_an_error(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "q", "answer": "1"}\n{"prompt": "r", "answer": "2"}\n')
    assert [item.answer for item in file_task(str(path)).items] == ["1", "2"]
    path.write_bytes(b'{"prompt": "q", "answer": "1"}\n\xef\xbb\xbf{"prompt": "r", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl:2: malformed row .*BOM"):
        file_task(str(path))


def test_a_system_message_and_data_system_prompt_clash(tmp_path):
    row = {"messages": [{"role": "system", "content": "s"}] + MSG, "answer": "1"}
    with pytest.raises(ValueError, match=":1: malformed row .*starts with a system message and "
                                          "data.system_prompt is set too"):
        file_task(write_jsonl(tmp_path / "t.jsonl", [row]), system_prompt="other")


@pytest.mark.parametrize("overrides,why", [
    (["data.task=gsm8k", "data.prompt_key=question"], "data.prompt_key applies to data.task=file only"),
    (["data.task=arith", "data.system_prompt=hi", "data.answer_key=a"],
     "data.answer_key, data.system_prompt apply to data.task=file only"),
    (["data.task=file", "data.few_shot=2"], "data.task=file takes no demonstrations"),
    (["data.task=file", "data.answer_key=messages"], "each must name a different field"),
    (["data.task=file", "data.prompt_key=''"], "data.prompt_key='' must name a field"),
])
def test_config_rules_for_the_file_keys(overrides, why):
    with pytest.raises(ValueError, match=why):
        load_config(None, overrides)


def test_parse_row_is_the_rule_alone():
    cfg = DataConfig(task="file")
    assert parse_row({"prompt": "q", "answer": 3}, cfg) == ([{"role": "user", "content": "q"}], "3")


def test_prompt_set_carries_the_row_and_names_the_rows_it_filters(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "short", "answer": "1", "id": 0}, {"prompt": "long " * 300, "answer": "2", "id": 1},
            {"prompt": "short too", "answer": "3", "id": 2}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ps = PromptSet(file_task(path), tok, max_prompt_len=64, seed=0)
    assert (len(ps), ps.num_filtered) == (2, 1)
    assert [ps.at(j).row for j in range(2)] == [rows[0], rows[2]]
    assert ps.at(1).gold == "3"
    assert ps.filtered_sources == [f"{path}:2"]
    assert f"1 longer than max_prompt_len=64 filtered ({path}:2; raise data.max_prompt_len" in ps.summary()


def test_the_documented_example_loads_and_its_reward_reads_the_row(tmp_path, monkeypatch):
    import pathlib
    import re

    from areal_async.reward.fn import keywords, resolve_reward_fn

    repo = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # the example's paths and module are relative to the checkout
    doc = (repo / "docs/configuration.md").read_text()
    section = doc[doc.index("## Your own data"):]
    snippet = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "own.yaml").write_text(snippet)
    cfg = load_config(tmp_path / "own.yaml")
    train, test = load_task(cfg.data, "train"), load_task(cfg.data, "test")
    assert (len(train), len(test)) == (8, 4) and cfg.eval.num_prompts <= len(test)
    assert train.messages(0)[0] == {"role": "system", "content": "Put the final answer in \\boxed{}."}
    fn = resolve_reward_fn(cfg.reward.fn)
    assert keywords(fn) == ("response", "answer", "item")
    k = next(i for i in range(len(train)) if train.item(i).row["tolerance"] > 0)  # 16.09 ± 0.1
    assert fn(response="\\boxed{16.1}", answer=train.gold(k), item=train.item(k).row) == 1.0
    assert fn(response="\\boxed{16.3}", answer=train.gold(k), item=train.item(k).row) == 0.0
    assert fn(response="\\boxed{16.3}", answer=train.gold(k), item={**train.item(k).row, "tolerance": 1}) == 1.0


def test_when_no_row_fits_the_error_names_the_shortest_and_no_few_shot(tmp_path, tiny_model_dir):
    # it said "raise data.max_prompt_len or lower data.few_shot", a key the file task refuses
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "long " * 300, "answer": "1"},
                                              {"prompt": "long " * 100, "answer": "2"}])
    with pytest.raises(ValueError, match=rf"no prompt of task 'file' fits data.max_prompt_len=64 tokens "
                                         rf"\(prompt lengths \d+\.\.\d+, the shortest {path}:2\); raise "
                                         rf"data.max_prompt_len \(and inference.max_seq_len\) or shorten the "
                                         rf"prompts$") as caught:
        PromptSet(file_task(path), tok, max_prompt_len=64, seed=0)
    assert "few_shot" not in str(caught.value)
