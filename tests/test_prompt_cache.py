"""The on-disk cache of tokenised prompts (``data/prompt_cache.py``): a hit gives the ids a fresh
tokenisation gives, and any input of those ids changing misses the cache (a new entry)."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from areal_async.data import prompt_cache
from areal_async.data.prompts import PromptSet
from areal_async.data.task import ChatTask, TaskItem
from areal_async.model.source import load_tokenizer

QUESTIONS = ["What is 2 + 3?", "Natalia sold clips to 48 of her friends in April. How many clips?",
             "A" * 40, "How many legs do 7 spiders have in total, if each has 8?", "Why?"]


def task(questions=QUESTIONS, system=None, demos=(), instruction="Answer in \\boxed{}."):
    items = [TaskItem(prompt=[{"role": "user", "content": q}], answer=str(i)) for i, q in enumerate(questions)]
    return ChatTask("t", items, demos=demos, system=system, instruction=instruction)


def ids(ps: PromptSet) -> list[tuple[int, list[int]]]:
    return [(ps.at(j).data_index, ps.at(j).prompt_ids) for j in range(len(ps))]


def tokenizer_copy(model_dir: pathlib.Path, dest: pathlib.Path, edit=None) -> pathlib.Path:
    """The tokenizer files of ``model_dir`` in ``dest``; ``edit(dest)`` changes them."""
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    if edit:
        edit(dest)
    return dest


def test_a_hit_gives_the_ids_of_a_fresh_tokenisation(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    fresh = PromptSet(task(), tok, 40, seed=3)
    first = PromptSet(task(), tok, 40, seed=3, cache_dir=tmp_path)
    again = PromptSet(task(), tok, 40, seed=3, cache_dir=tmp_path)
    assert (fresh.cache_status, first.cache_status, again.cache_status) == ("off", "miss", "hit")
    assert ids(again) == ids(first) == ids(fresh)
    assert again.num_filtered == fresh.num_filtered > 0  # "A" * 40 is over 40 tokens
    assert [again.for_group(g) for g in range(12)] == [fresh.for_group(g) for g in range(12)]
    assert len(list(tmp_path.glob("*.npz"))) == 1
    longer = PromptSet(task(), tok, 400, seed=3, cache_dir=tmp_path)  # filtering follows the read
    assert longer.cache_status == "hit" and ids(longer) == ids(PromptSet(task(), tok, 400, seed=3))


def _template(d: pathlib.Path) -> None:
    path = d / "chat_template.jinja"
    path.write_text(path.read_text().replace("<|im_start|>", "<|im_start|> "))


def _lowercase(d: pathlib.Path) -> None:
    config = json.loads((d / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "Lowercase"}
    (d / "tokenizer.json").write_text(json.dumps(config))


CHANGES = {  # name -> (task, tokenizer files edit)
    "system turn": (task(system="Be brief."), None),
    "few-shot": (task(demos=[("1 + 1?", "\\boxed{2}")]), None),
    "instruction": (task(instruction="Think."), None),
    "one item": (task(QUESTIONS[:-1] + ["Why not?"]), None),
    "chat template": (task(), _template),
    "tokenizer file": (task(), _lowercase),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_any_input_changing_misses_the_cache(tiny_model_dir, tmp_path, change):
    base_tok = load_tokenizer(tiny_model_dir)
    PromptSet(task(), base_tok, 400, seed=0, cache_dir=tmp_path / "cache")
    changed_task, edit = CHANGES[change]
    tok = load_tokenizer(tokenizer_copy(tiny_model_dir, tmp_path / "tok", edit)) if edit else base_tok
    ps = PromptSet(changed_task, tok, 400, seed=0, cache_dir=tmp_path / "cache")
    assert ps.cache_status == "miss"
    assert ids(ps) == ids(PromptSet(changed_task, tok, 400, seed=0)) != ids(PromptSet(task(), base_tok, 400, seed=0))
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_a_token_added_to_the_loaded_tokenizer_misses_the_cache(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    before = ids(PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path))
    tok.add_tokens(["clips"])
    ps = PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path)
    assert ps.cache_status == "miss" and ids(ps) == ids(PromptSet(task(), tok, 400, seed=0)) != before


def test_a_library_version_is_part_of_the_key(tiny_model_dir, tmp_path, monkeypatch):
    tok = load_tokenizer(tiny_model_dir)
    before = prompt_cache.cache_key(task(), tok)
    real = prompt_cache.importlib.metadata.version
    monkeypatch.setattr(prompt_cache.importlib.metadata, "version",
                        lambda lib: "0.0" if lib == "jinja2" else real(lib))
    assert prompt_cache.cache_key(task(), tok) not in (before, None)


def test_a_bad_entry_is_rebuilt_and_a_clock_template_not_cached(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.npz")
    with np.load(entry) as e:
        stored = dict(e)
    stored["ids"] = stored["ids"] + 1  # what a key missing an input would serve
    with open(entry, "wb") as f:
        np.savez(f, **stored)
    stale = PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path)
    assert stale.cache_status == "stale" and ids(stale) == ids(PromptSet(task(), tok, 400, seed=0))
    assert PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path).cache_status == "hit"
    entry.write_bytes(b"not a zip")
    assert PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path).cache_status == "miss"
    tok.chat_template = "{{ strftime_now('%d %b %Y') }}" + tok.chat_template
    assert PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path).cache_status == "off"


def test_a_tokenizer_changed_after_loading_misses_the_cache(tiny_model_dir, tmp_path):
    from tokenizers.normalizers import Lowercase

    tok = load_tokenizer(tiny_model_dir)
    before = ids(PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path))
    tok.backend_tokenizer.normalizer = Lowercase()  # the files are as they were
    ps = PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path)
    assert ps.cache_status == "miss" and ids(ps) == ids(PromptSet(task(), tok, 400, seed=0)) != before


def test_a_torn_entry_is_a_miss_and_an_unreadable_file_turns_the_cache_off(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c").glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:-100])  # zipfile.BadZipFile when read
    torn = PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path / "c")
    assert torn.cache_status == "miss" and ids(torn) == ids(PromptSet(task(), tok, 400, seed=0))
    d = tokenizer_copy(tiny_model_dir, tmp_path / "tok")
    (d / "notes.txt").symlink_to("/proc/self/mem")  # a file whose read fails (EIO); loading never reads it
    assert PromptSet(task(), load_tokenizer(d), 400, seed=0, cache_dir=tmp_path / "c").cache_status == "off"


def test_a_cache_that_cannot_take_the_entry_leaves_no_file(tiny_model_dir, tmp_path, monkeypatch):
    tok = load_tokenizer(tiny_model_dir)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_cache.np, "savez_compressed", full)
    ps = PromptSet(task(), tok, 400, seed=0, cache_dir=tmp_path)
    assert ps.cache_status == "unwritable" and ids(ps) == ids(PromptSet(task(), tok, 400, seed=0))
    assert [p.name for p in tmp_path.iterdir()] == []
