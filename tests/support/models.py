"""The tiny causal LMs (2 layers, hidden 64) with a real byte-level BPE tokenizer, and what tests
do with one: a chat prompt's ids, a perturbed copy, the trainer-side log-prob recompute.

The tokenizer is trained here from a few GSM8K questions (no downloads), has a chat template, and
an ``<|im_end|>`` end-of-sequence token, so prompts are built the same way as for real models.
The fixtures of ``tests/conftest.py`` build the models once per session with ``build_tiny_model``.
"""

from __future__ import annotations

import json
import pathlib

import torch

from tests.support import REPO

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


def prompt_ids(model_dir, question: str = "How many apples are left?") -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def perturbed(model_dir, seed: int):
    """The tiny model with every parameter moved by N(0, 0.3²) (its logits are near-flat, so a
    small move would not change which tokens the fixed noise picks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def recompute_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """Trainer-side recompute: log_softmax(logits / T) of each output token, one HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
