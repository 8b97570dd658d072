"""Shared fixtures: tiny causal LMs (2 layers, hidden 64) with a real byte-level BPE tokenizer.

The tokenizer is trained in the fixture from a few GSM8K questions (no downloads), has a chat
template, and an ``<|im_end|>`` end-of-sequence token, so prompts are built the same way as for
real models.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

# Without a GPU, Triton kernels (installed with the dev extra) run in Triton's CPU interpreter, so
# the engine's CUDA kernels are checked on every machine; it must be chosen before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(out_dir: pathlib.Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = (REPO / "data/gsm8k/train.jsonl").read_text().splitlines()[:400]
    corpus = [json.loads(x)["question"] + " " + json.loads(x)["answer"] for x in lines]
    corpus += ["Put the final answer in \\boxed{}. The answer is \\boxed{42}."] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: pathlib.Path, arch: str = "llama", seed: int = 0) -> pathlib.Path:
    """Write a tiny random ``arch`` (``llama`` | ``qwen3``) checkpoint + tokenizer to ``out_dir``.

    2 layers, hidden 64, 4 query heads / 2 KV heads (GQA), fp32 safetensors, tied embeddings.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(f"unknown tiny arch '{arch}'")
    model.to(torch.float32).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Llama checkpoint directory (fp32), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3 checkpoint directory (fp32, q/k norms), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture
def multi_eos_model_dir(tiny_model_dir, tmp_path) -> pathlib.Path:
    """A copy of the tiny Llama whose ``generation_config.json`` lists two end-of-sequence ids,
    ``[<|im_end|>, <|endoftext|>]`` = ``[2, 0]``, where ``config.json`` has one (2), as Qwen2.5 /
    Qwen3 releases do, plus a sampling default (``temperature`` 0.7)."""
    import shutil

    out = shutil.copytree(tiny_model_dir, tmp_path / "multi-eos")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 == json.loads((out / "config.json").read_text())["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0], "temperature": 0.7},
                                                           indent=2) + "\n")
    return out


@pytest.fixture
def one_torch_thread():
    """Run the test with one intra-op thread (the servers' setting on a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def umask_027() -> int:
    """Run the test under umask 027; returns the mode a new file then gets (0o640)."""
    before = os.umask(0o027)
    yield 0o640
    os.umask(before)
