"""torch dtypes by name (``"bfloat16"``, as configs, CLI flags and SGLang's weight requests spell
them): ``FLOAT_DTYPES`` a model may run in; ``DTYPES`` adds the integer dtypes a weight bucket may carry."""

from __future__ import annotations

from collections.abc import Mapping

import torch

FLOAT_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPES: Mapping[str, torch.dtype] = {**FLOAT_DTYPES, "int64": torch.int64, "int32": torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the form configs and SGLang's ``dtypes`` field use)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, names: Mapping[str, torch.dtype] = DTYPES, what: str = "dtype") -> torch.dtype:
    """Inverse of ``dtype_name``: ``"bfloat16"`` (or ``"torch.bfloat16"``) → ``torch.bfloat16``.

    Args:
        name: a dtype name, with or without the ``torch.`` prefix.
        names: the dtypes accepted here (``DTYPES``, ``FLOAT_DTYPES`` or a subset).
        what: how the error names the value (``"weight dtype"``, ``"trainer.dtype"``).

    Raises:
        ValueError: ``name`` is not in ``names``; the message names it and the valid names.
    """
    try:
        return names[name.removeprefix("torch.")]
    except (KeyError, AttributeError):
        raise ValueError(f"unsupported {what} {name!r}; use one of {sorted(names)}") from None
