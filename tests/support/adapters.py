"""peft adapters on the tiny models, as the trainer's LoRA module provides them
(``areal_async/trainer/lora.py``'s ``adapter_parameters`` / ``adapter_config`` contract), for the
LoRA sync's tests; and what a server holding one must serve (``reference``, ``assert_serves``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from areal_async.trainer.lora_sync import ALL_LINEAR

R, ALPHA = 4, 8


def peft_policy(model_dir, seed: int = 0):
    """The tiny model wrapped by peft (all linears, r=4, alpha=8), its adapter random (B too: peft's
    default zero B would leave the outputs unchanged) and large enough to move greedy tokens."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(ALL_LINEAR),
                                            lora_dropout=0.0, init_lora_weights=False))
    step(model, seed)
    return model.eval()


def step(model, seed: int) -> None:
    """A stand-in optimizer step: every adapter tensor moved by N(0, 0.3²)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def adapter_items(model):
    """``lora.adapter_parameters``' contract on one rank: peft's names, full tensors."""
    from peft import get_peft_model_state_dict

    return lambda: iter(get_peft_model_state_dict(model).items())


def adapter_config(model) -> dict:
    return model.peft_config["default"].to_dict()


TOKENS = 8


def reference(model, prompt: list[int], n: int = TOKENS) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of ``model`` (peft's unmerged forward) and their log-probs (log_softmax)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], torch.tensor(logprobs)


GREEDY = {"max_new_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}


def served(resp: dict) -> tuple[list[int], torch.Tensor, int, int]:
    meta = resp["meta_info"]
    return (resp["output_ids"], torch.tensor([e[0] for e in meta["output_token_logprobs"]]),
            int(meta["weight_version"]), meta["cached_tokens"])


def assert_serves(resp: dict, model, prompt: list[int], version: int) -> None:
    ids, logprobs, v, _ = served(resp)
    want_ids, want_logprobs = reference(model, prompt)
    assert v == version
    assert ids == want_ids
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)
