"""``areal_async/flops.py``: parameter counts and training FLOPs against values derived by hand on
the tiny Qwen3 shape (hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 K/V heads, vocab
1024, tied), and the Qwen3 shapes of ``tools/qwen3_shapes.py`` counted on the meta device."""

from __future__ import annotations


import pytest
import torch

from areal_async.flops import (DecoderShape, causal_pairs, lora_params, shared_prompt_pairs, train_flops,
                               train_flops_per_token)
from tests.support.tools import load_tool

TINY = DecoderShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=1024, tied=True)


@pytest.fixture(scope="module")
def shapes():
    return load_tool("qwen3_shapes")


def test_tiny_params_by_hand():
    # per layer: q 64·64 = 4096, k 64·32 = 2048, v 2048, o 4096, gate 64·128 = 8192, up 8192,
    # down 8192 -> 36864 matmul weights; 2 RMSNorms of 64 and q/k norms of 16 each -> 160;
    # 2 layers: 2·37024 = 74048; final norm 64; embedding 1024·64 = 65536 (tied: once) -> 139648
    assert TINY.params() == 139_648
    assert TINY.matmul_params() == 139_648  # tied: the embedding is the LM head's matmul
    untied = DecoderShape(**{**TINY.__dict__, "tied": False})
    assert untied.params() == 139_648 + 65_536  # an LM head of its own
    assert untied.matmul_params() == 139_648  # the input embedding is a lookup


def test_tiny_lora_params_by_hand():
    # r·(in + out) per linear, r = 8: q 8·128, k 8·96, v 8·96, o 8·128, gate 8·192, up 8·192,
    # down 8·192 -> 8·1024 = 8192 per layer, 2 layers -> 16384
    assert lora_params(TINY, 8) == 16_384
    assert lora_params(TINY, 8, "all-linear") == 16_384
    # q and v only: 8·(128 + 96)·2 = 3584; a list, a comma-separated string, duplicates once
    assert lora_params(TINY, 8, ["q_proj", "v_proj"]) == 3_584
    assert lora_params(TINY, 8, "q_proj, v_proj,q_proj") == 3_584
    with pytest.raises(ValueError, match="lm_head"):
        lora_params(TINY, 8, ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="rank=0"):
        lora_params(TINY, 0)


def test_pairs_by_hand():
    assert causal_pairs([10, 4]) == 50 + 8
    # prompt 4 once: 8; response 2 over it: 2·4 + 2 = 10; response 3: 3·4 + 4.5 = 16.5
    assert shared_prompt_pairs(4, [2, 3]) == 34.5
    # = the two whole sequences (6, 7) unshared, 18 + 24.5, less the prompt's second copy, 8
    assert shared_prompt_pairs(4, [2, 3]) == causal_pairs([6, 7]) - causal_pairs([4])


def test_train_flops_by_hand():
    # one sequence of 10 tokens: 50 pairs; attention 12·layers·H·D·pairs = 12·2·4·16·50 = 76800
    full = train_flops(TINY, 10, 50)
    assert full == 6 * 139_648 * 10 + 76_800 == 8_455_680
    # LoRA r = 8 on every linear: (4·139648 + 6·16384)·10 + 76800 = 6568960 + 76800
    lora = train_flops(TINY, 10, 50, adapter_params=16_384)
    assert lora == 6_645_760
    # per token, a full window of 10: 6·N + 6·layers·H·D·L = 837888 + 7680
    assert train_flops_per_token(TINY, 10) == 845_568 == full / 10
    assert train_flops_per_token(TINY, 10, adapter_params=16_384) == lora / 10


def test_shapes_match_the_meta_model(shapes):
    from transformers import Qwen3ForCausalLM

    published = {"0.6b": 0.596e9, "1.7b": 1.72e9, "4b": 4.02e9, "8b": 8.19e9}  # the model cards' totals
    for name in ("tiny", *published):
        with torch.device("meta"):  # no allocation: 8B parameters cost nothing here
            model = Qwen3ForCausalLM(shapes.config(name))
        counted = sum(p.numel() for p in model.parameters())  # a tied matrix once
        assert DecoderShape.from_hf(model.config).params() == counted, name
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == shapes.SHAPES[name]["tie_word_embeddings"]
        if name in published:
            assert counted == pytest.approx(published[name], rel=3e-3), name
    assert counted == 8_190_735_360  # 8b, the last: Qwen3-8B's 8.19B, untied
    assert model.config.rope_parameters["rope_theta"] == 1_000_000.0
    assert DecoderShape.from_hf(model.config).matmul_params() == 8_190_735_360 - 151_936 * 4096
