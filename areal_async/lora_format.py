"""The peft LoRA adapter format both sides of a weight sync read: file names, tensor names and
``check_adapter_tensors``, the check that an adapter's tensors fit a model's linear layers."""

from __future__ import annotations

import re

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")


def check_adapter_tensors(named: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], r: int) -> None:
    """Raise ``ValueError`` unless every name is a peft LoRA tensor of a 2-D, untied weight of
    the model, with the shape that weight and ``r`` give (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``)."""
    for name, shape in shapes.items():
        found = LORA_TENSOR.fullmatch(name)
        if found is None:
            raise ValueError(f"'{name}' is not a peft LoRA tensor name (expected "
                             f"'base_model.model.<module>.lora_A.weight' or '...lora_B.weight')")
        weight = f"{found['module']}.weight"
        live = named.get(weight)
        if live is None or live.dim() != 2:
            raise ValueError(f"adapter tensor '{name}' targets '{found['module']}', which is not a linear layer of "
                             f"this model (no 2-D weight '{weight}')")
        if any(other is live for key, other in named.items() if key != weight):
            raise ValueError(f"adapter tensor '{name}' targets '{weight}', a weight tied to another one (merging "
                             f"would change both); leave tied modules out of target_modules")
        out_features, in_features = live.shape
        want = (r, in_features) if found["ab"] == "A" else (out_features, r)
        if tuple(shape) != want:
            raise ValueError(f"adapter tensor '{name}' has shape {list(shape)}; with r={r} and '{weight}' of shape "
                             f"{list(live.shape)} it must be {list(want)}")
