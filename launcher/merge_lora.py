"""Merge a LoRA checkpoint into a full HF checkpoint.

    python -m launcher.merge_lora ADAPTER_DIR OUT_DIR [--base PATH] [--dtype float32|bfloat16] [--overwrite]

``ADAPTER_DIR``: a LoRA run's ``RUN_DIR/checkpoint``, a disk weight sync's ``RUN_DIR/adapters/vN``
(or any peft adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``). The base
is ``--base`` or the adapter config's ``base_model_name_or_path`` (the run's ``model.path``); it is
rounded to the dtype ``lora_base.json`` records (e.g. bfloat16; float32 without one): the trainer's
for a checkpoint, as the trained adapters saw it, the servers' for ``adapters/vN``, as served; then
peft's ``merge_and_unload`` adds ``(alpha/r) · B A`` in fp32. ``OUT_DIR`` gets the weights in
``--dtype`` (default float32, as a full fine-tuning checkpoint) with the base's config,
generation config and tokenizer files (``checkpoint.save_hf_checkpoint``), written atomically;
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it. ``OUT_DIR`` may not hold, or lie
inside, ``ADAPTER_DIR`` or the base; an existing non-empty one is replaced only with
``--overwrite``. docs/lora.md.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from areal_async.atomic_dir import write_atomically
from areal_async.config import ModelConfig
from areal_async.dtypes import FLOAT_DTYPES, dtype_from_name
from areal_async.trainer.checkpoint import save_hf_checkpoint
from areal_async.trainer.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_BASE, adapter_shapes, check_adapter_fits,
                                      read_adapter_config, read_base_dtype)


def check_out_dir(adapter_dir: pathlib.Path, out_dir: pathlib.Path, overwrite: bool,
                  base: pathlib.Path | None = None) -> None:
    """Refuse an ``out_dir`` whose replacement would lose data: the ``base`` model's directory, a
    directory holding it or one inside it (the adapter would lose its base), the same for
    ``adapter_dir`` (its run directory), or, without ``overwrite``, any non-empty one.

    Raises:
        ValueError: naming ``out_dir`` and the fix.
    """
    o = out_dir.resolve()
    for what, d in (("the base model", base), ("the adapter directory", adapter_dir)):
        if d is None:
            continue
        d = d.resolve()
        if o == d or o in d.parents or d in o.parents:
            raise ValueError(f"OUT_DIR {out_dir} {'is' if o == d else 'holds' if o in d.parents else 'lies inside'} "
                             f"{what} {d}: writing it would replace it; give a new directory outside it, e.g. "
                             f"{adapter_dir.resolve().parent.parent / (adapter_dir.resolve().parent.name + '-merged')}")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"OUT_DIR {out_dir} exists and is not empty; give a new directory, or pass "
                         f"--overwrite to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUT_DIR {out_dir} is a file; give a directory path")


def resolve_base(adapter_dir: pathlib.Path, base: str | None) -> pathlib.Path:
    """The base model's HF directory: ``base`` (``--base``, a directory or a built-in name, as
    ``model.path``) or, without it, the adapter config's ``base_model_name_or_path``.

    Raises:
        ValueError: no base given and none recorded, or one that is neither a directory with
            ``config.json`` nor a built-in model name.
    """
    from areal_async.model.source import BUILTIN_MODELS, resolve_model_path

    recorded = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    name = base or recorded
    if not name:
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG} names no base model: give --base PATH")
    if name not in BUILTIN_MODELS and not (pathlib.Path(name).expanduser() / "config.json").is_file():
        where = "--base" if base else f"the base recorded in {adapter_dir / ADAPTER_CONFIG},"
        raise ValueError(f"{where} {name!r} is neither an HF checkpoint directory (with config.json) nor a built-in "
                         f"model name ({', '.join(sorted(BUILTIN_MODELS))}); give --base PATH, the model.path "
                         f"the adapter was trained on")
    return resolve_model_path(ModelConfig(path=name))


def check_base_fits(adapter_dir: pathlib.Path, base: pathlib.Path) -> None:
    """Check that every tensor of ``adapter_dir`` adapts a linear layer of ``base`` with its shape
    (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``); the base is built on the meta device.

    Raises:
        ValueError: naming the first tensor that does not fit, the base, and the one recorded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter_shapes(adapter_dir)  # a damaged file is named as such, not as another base
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    try:
        check_adapter_fits(adapter_dir, lm)
    except ValueError as exc:
        trained_on = read_adapter_config(adapter_dir).get("base_model_name_or_path")
        raise ValueError(f"{adapter_dir} does not fit the base {base}: {exc}. It was trained on "
                         f"{trained_on!r}; give --base PATH of that model") from None


def merge(adapter_dir: str | pathlib.Path, out_dir: str | pathlib.Path, base: str | None = None,
          dtype: torch.dtype = torch.float32, overwrite: bool = False) -> pathlib.Path:
    """Write the merged model of ``adapter_dir`` (on ``base``) into ``out_dir``; returns ``out_dir``.

    Raises:
        FileNotFoundError: ``adapter_dir`` holds no adapter (a full fine-tuning checkpoint is a
            full HF directory already).
        ValueError: a base that ``resolve_base`` refuses or the adapter does not fit
            (``check_base_fits``), or an ``out_dir`` refused by ``check_out_dir``.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir, out_dir = pathlib.Path(adapter_dir), pathlib.Path(out_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).is_file():
            raise FileNotFoundError(f"{adapter_dir / name} does not exist: {adapter_dir} is no LoRA checkpoint "
                                    f"(a run with trainer.lora.rank=0 checkpoints a full HF directory, "
                                    f"loadable as it is)")
    check_out_dir(adapter_dir, out_dir, overwrite)
    base = resolve_base(adapter_dir, base)
    check_out_dir(adapter_dir, out_dir, overwrite, base)
    check_base_fits(adapter_dir, base)
    stored = dtype_from_name(read_base_dtype(adapter_dir) or "float32", FLOAT_DTYPES, f"{LORA_BASE} base_dtype")
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in lm.parameters():  # the base as the trainer held it (tied weights: one Parameter)
            p.data = p.data.to(stored).float()
    merged = PeftModel.from_pretrained(lm, str(adapter_dir)).merge_and_unload()
    state = {k: v.detach() for k, v in merged.state_dict().items()}
    with write_atomically(out_dir) as staging:
        save_hf_checkpoint(state, base, staging, dtype)
    return pathlib.Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.merge_lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="a LoRA checkpoint (RUN_DIR/checkpoint) or peft adapter directory")
    parser.add_argument("out_dir", help="where the merged HF checkpoint is written")
    parser.add_argument("--base", default=None, help="the base model (default: the adapter config's "
                                                      "base_model_name_or_path)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the merged weights (default float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty OUT_DIR")
    args = parser.parse_args(argv)
    try:
        out = merge(args.adapter_dir, args.out_dir, args.base, FLOAT_DTYPES[args.dtype], args.overwrite)
    except (OSError, ValueError) as exc:  # a missing adapter or base, a refused OUT_DIR
        parser.exit(2, f"python -m launcher.merge_lora: error: {exc}\n")
    print(f"merged {args.adapter_dir} into {out}")


if __name__ == "__main__":
    main()
