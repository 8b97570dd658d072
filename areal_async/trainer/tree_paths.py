"""The tree attention paths and which one ``trainer.tree_attention`` takes on a given device.

``TREE_PATHS``: ``varlen``, ``flex``, ``sdpa`` (what each computes: ``trainer/attention.py``;
docs/trainer.md "Tree attention paths"). ``tree_attention_choice`` turns a setting (``auto`` or a
path) into a path, or refuses a path whose kernel does not run there. It is a pure function of
plain values, without torch, so that the launcher resolves ``auto`` before the job starts
(``launcher/resolve.py``) without importing the kernels; ``step.train_step`` calls it again on the
trainer's own device.
"""

from __future__ import annotations

TREE_PATHS = ("varlen", "flex", "sdpa")


def tree_attention_choice(setting: str, cuda: bool, dtype: str, deterministic: bool) -> str:
    """The tree attention path ``trainer.tree_attention=setting`` takes: ``auto`` → ``varlen`` on
    CUDA with a bf16/fp16 compute ``dtype`` (``auto`` counts as bf16 there, see ``resolve_dtypes``
    in ``launcher/resolve.py``) outside deterministic algorithms, else ``sdpa``; any other value
    itself.

    Args:
        setting: ``auto``, ``varlen``, ``flex`` or ``sdpa``.
        cuda: the trainer runs on CUDA.
        dtype: ``trainer.dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``).
        deterministic: deterministic algorithms (``mode: deterministic``) are on.

    Raises:
        ValueError: ``setting`` is unknown, or ``varlen``/``flex`` where their kernels do not run:
            on CPU, with float32, or with deterministic algorithms (neither kernel's backward is
            deterministic).
    """
    if setting not in ("auto", *TREE_PATHS):
        raise ValueError(f"trainer.tree_attention={setting!r} is not a path; use auto, varlen, flex or sdpa")
    half = dtype in ("bfloat16", "float16") or (dtype == "auto" and cuda)
    if setting == "auto":
        return "varlen" if cuda and half and not deterministic else "sdpa"
    if setting in ("varlen", "flex"):
        why = ("the trainer runs on CPU" if not cuda else f"trainer.dtype={dtype} (the kernel takes bf16/fp16)"
               if not half else "deterministic algorithms are on (its backward is not deterministic)"
               if deterministic else None)
        if why is not None:
            raise ValueError(f"trainer.tree_attention={setting} needs CUDA with bf16/fp16 outside deterministic "
                             f"mode, but {why}; use trainer.tree_attention=auto (or sdpa)")
    return setting
