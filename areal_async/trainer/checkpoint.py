"""HF checkpoints of the trained policy: a ``save_pretrained`` directory plus the tokenizer.

The directory is what ``AutoModelForCausalLM.from_pretrained`` and both inference backends load
(``/update_weights_from_disk``, a fresh server's ``--model-path``). The config and tokenizer are
copied from the starting checkpoint; the weights are the gathered full state dict, cast to the
requested dtype. Saving builds the model skeleton on the ``meta`` device and assigns the tensors,
so no second copy of the weights is allocated. ``state_dict_sha256`` fingerprints a state dict
(bitwise run-to-run comparisons).
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def save_hf_checkpoint(
    state_dict: dict[str, Tensor],
    base_model_path: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    dtype: torch.dtype = torch.float32,
) -> pathlib.Path:
    """Write ``state_dict`` (HF names) as safetensors + config + tokenizer into ``out_dir``.

    Args:
        state_dict: full tensors keyed by HF parameter name (e.g. from
            ``parallel.full_state_dict``); a tied ``lm_head.weight`` may be absent.
        base_model_path: the starting HF directory (config, tokenizer, chat template).
        out_dir: target directory; replaced atomically (written to ``out_dir.tmp`` then renamed).
        dtype: dtype of the saved weights.

    Raises:
        ValueError: ``state_dict`` misses parameters of the model or has unknown ones.
    """
    out_dir = pathlib.Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = AutoConfig.from_pretrained(base_model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(f"state dict does not match {base_model_path}: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:5]}")
    if tied:
        model.tie_weights()
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base_model_path).save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def state_dict_sha256(state_dict: dict[str, Tensor]) -> str:
    """SHA-256 (hex) over a state dict: names in sorted order, each with dtype, shape and raw bytes.

    Two checkpoints hash equal iff every tensor is bitwise equal (used to compare runs).
    """
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
