"""Qwen3-shaped causal LMs with random weights, for GPU benchmarks on machines without checkpoints.

The shapes follow the public Qwen3 configs (``0.6b``, ``1.7b``, ``4b`` with a tied LM head; ``8b``
with its own LM head, ``tie_word_embeddings: false`` as in Qwen/Qwen3-8B's config.json); ``tiny`` (2
layers, hidden 64) is for checking a benchmark script on a CPU. Parameter counts (the tied matrix
once): 0.6b 596M, 1.7b 1.72B, 4b 4.02B, 8b 8.19B (tests/test_qwen3_shapes.py builds each on the meta
device and checks them). Weights are the transformers default initialisation from
a fixed seed, so two processes that build the same shape with the same seed hold identical weights.
``write_model_dir`` also writes a small byte-level BPE tokenizer with a chat template (its
vocabulary is far smaller than the model's: ids it does not know decode to nothing), so the
directory works as ``model.path`` of a whole training job.

    python tools/qwen3_shapes.py 0.6b OUT_DIR     # write a random checkpoint directory
"""

from __future__ import annotations

import pathlib

import torch

from areal_async.atomic_dir import give_user_file_mode

# ``tie_word_embeddings``: the LM head is the input embedding (True) or a matrix of its own (False)
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
EOS_ID = 2  # "<|im_end|>" in the tokenizer below
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def config(shape: str):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)


def build_model(shape: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A ``Qwen3ForCausalLM`` of ``shape`` with random weights (seeded), in eval mode."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config(shape))
    return model.to(dtype).eval()


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["How many clips did Natalia sell in April and May altogether?"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_model_dir(shape: str, out_dir: str | pathlib.Path, dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0) -> pathlib.Path:
    """Save a random ``shape`` model (safetensors, ``dtype``) and a tokenizer to ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_model(shape, dtype, "cpu", seed).save_pretrained(out)
    _tokenizer().save_pretrained(out)
    give_user_file_mode(out)  # safetensors wrote its file 0600
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters (a tied embedding / LM head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V bytes that one cached token position holds over all layers."""
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).element_size()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Write a Qwen3-shaped model with random weights (HF directory).")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out_dir")
    args = ap.parse_args()
    print(write_model_dir(args.shape, args.out_dir))
