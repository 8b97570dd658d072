"""LoRA adapters on the policy with peft (``trainer.lora``; docs/lora.md).

``add_adapters`` injects peft's LoRA layers into the HF model in place (``peft.inject_adapter_in_model``,
adapter ``"default"``), before packed attention, batch-invariant linears and the FSDP2/DDP
wrapping: each targeted ``nn.Linear`` becomes a ``peft`` ``lora.Linear`` holding it as ``base_layer``
next to ``lora_A`` / ``lora_B`` (both ``nn.Linear``, so ``make_linears_batch_invariant`` tiles them
too). Invariants: every parameter that is not an adapter's is frozen and stored in the compute
dtype (``trainer.dtype``); the adapters are fp32 and are the only trainable parameters; the HF
model keeps its class, its ``model`` / ``lm_head`` and its parameter order, so ``PackedPolicy``
runs it unchanged.

Public, for the weight sync: ``lora_enabled``, ``adapter_parameters`` (a collective, like
``policy.full_parameters``) and ``adapter_config``; for the launcher, ``initial_adapter`` (version 0,
from the model's config alone: what an SGLang server of a LoRA job starts with). Names are peft's
(``get_peft_model_state_dict``: ``base_model.model.<hf module>.lora_A.weight``), so a directory with
``adapter_model.safetensors`` of those tensors and ``adapter_config.json`` of that dict is what
``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` loads (``write_adapter_dir``).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from areal_async.config import ALL_LINEAR
from areal_async.config import LoraConfig as LoraSettings
from areal_async.lora_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_tensors

ADAPTER_NAME = "default"  # peft's adapter name inside the modules (dropped from the saved names)
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF model's names
# the base's storage dtype during training (the merge rounds the base to it, as the trainer did)
LORA_BASE = "lora_base.json"


def _lm(policy: nn.Module) -> nn.Module:
    """The HF model inside a ``PackedPolicy`` (possibly DDP-wrapped or FSDP2-sharded), or the
    HF model itself."""
    inner = policy.module if isinstance(policy, nn.parallel.DistributedDataParallel) else policy
    return getattr(inner, "lm", inner)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def lora_alpha(cfg: LoraSettings) -> float:
    """``trainer.lora.alpha``, 0 meaning ``2 * rank``."""
    return float(cfg.alpha) if cfg.alpha else 2.0 * cfg.rank


def block_linear_names(lm: nn.Module) -> list[str]:
    """The names (last component) of the ``nn.Linear`` modules of the decoder blocks
    (``lm.model.layers``), in order of first appearance: ``q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj`` for Llama/Qwen."""
    names: list[str] = []
    for name, module in lm.model.layers.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf not in names:
            names.append(leaf)
    return names


def resolve_target_modules(lm: nn.Module, target: str | tuple[str, ...] | list[str]) -> list[str]:
    """``trainer.lora.target_modules`` as the list of module names to adapt.

    Raises:
        ValueError: a name that is no linear layer of the decoder blocks (the message lists those).
    """
    found = block_linear_names(lm)
    if target == ALL_LINEAR:
        return found
    unknown = [t for t in target if t not in found]
    if unknown:
        raise ValueError(f"trainer.lora.target_modules={list(target)}: {unknown} "
                         f"{'is no' if len(unknown) == 1 else 'are no'} linear layer of the decoder blocks of this "
                         f"model, whose linear layers are {found}; give some of those, or 'all-linear' for all")
    return list(dict.fromkeys(target))


def check_rank(lm: nn.Module, targets: list[str], rank: int) -> None:
    """Refuse a ``rank`` above ``min(in, out)`` of every targeted linear of the decoder blocks:
    ``B A`` of such a layer has rank at most ``min(in, out)``, so the extra rows and columns only
    cost memory (``rank`` 1e5 on SmolLM2-135M: 3e10 adapter parameters).

    Raises:
        ValueError: naming ``rank``, the largest useful one and the layer that gives it.
    """
    widths = {}
    for name, module in lm.model.layers.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in targets:
            widths[leaf] = max(widths.get(leaf, 0), min(module.in_features, module.out_features))
    widest = max(widths, key=widths.get)
    if rank > widths[widest]:
        raise ValueError(f"trainer.lora.rank={rank} is above every targeted layer's width: the update B·A of a "
                         f"layer has rank at most min(in, out), at most {widths[widest]} here ({widest}; "
                         f"target_modules {targets}); give trainer.lora.rank={widths[widest]} or less "
                         f"(8-64 is usual)")


def _block_pattern(targets: list[str]) -> str:
    """The adapted modules as the regex peft full-matches against module names: the ``targets``
    linears inside the decoder blocks only (peft would match a bare name anywhere in the model)."""
    return rf"model\.layers\.\d+\..*\b({'|'.join(targets)})$"


def make_peft_config(cfg: LoraSettings, target_modules: list[str], base_model_path: str):
    """peft's ``LoraConfig`` for ``trainer.lora`` (a causal LM, no bias, peft's default init: A
    Kaiming-uniform, B zero, so the adapted model starts as the base)."""
    import peft

    return peft.LoraConfig(r=cfg.rank, lora_alpha=lora_alpha(cfg), lora_dropout=cfg.dropout,
                           target_modules=list(target_modules), bias="none", task_type="CAUSAL_LM",
                           base_model_name_or_path=str(base_model_path))


class GradOnlyDropout(nn.Dropout):
    """Dropout in the forward passes that build gradients only: the no-grad passes (π_prox, the
    log-probs compared with the servers') see the deterministic adapted policy, as the servers do.
    peft's ``nn.Dropout`` follows the module's mode instead: its layers are created in training
    mode, so it would drop in every pass."""

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, training=torch.is_grad_enabled())


def is_adapter_name(name: str) -> bool:
    """Whether the HF model's parameter ``name`` is a LoRA adapter's."""
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name


def peft_name(name: str) -> str:
    """The HF model's adapter parameter name as ``get_peft_model_state_dict`` names it:
    ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` →
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER_NAME}.", ".lora_B.")


def add_adapters(lm: nn.Module, cfg: LoraSettings, base_model_path: str, compute_dtype: torch.dtype,
                 adapter_dir: str | pathlib.Path | None = None) -> int:
    """Inject fp32 LoRA adapters into the HF model ``lm`` (loaded in ``compute_dtype`` or fp32)
    in place; freeze every other parameter and store it in ``compute_dtype``; load the adapters of
    ``adapter_dir`` (a checkpoint) when given. Call before anything replaces a linear's
    ``forward`` (``make_linears_batch_invariant``) and before any wrapping. Returns the number of
    adapted layers.

    Raises:
        ValueError: bad ``target_modules`` (see ``resolve_target_modules``), a rank refused by
            ``check_rank``, or ``adapter_dir``'s
            tensors do not match the adapters.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    targets = resolve_target_modules(lm, cfg.target_modules)
    check_rank(lm, targets, cfg.rank)
    peft_cfg = make_peft_config(cfg, targets, base_model_path)
    peft_cfg.target_modules = _block_pattern(targets)
    inject_adapter_in_model(peft_cfg, lm, adapter_name=ADAPTER_NAME)
    peft_cfg.target_modules = set(targets)  # what adapter_config.json names (servers, PeftModel)
    layers = [m for name, m in lm.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ValueError(f"trainer.lora.target_modules={targets}: no layer was adapted")
    for module in layers:
        drop = module.lora_dropout[ADAPTER_NAME]
        if isinstance(drop, nn.Dropout):
            module.lora_dropout[ADAPTER_NAME] = GradOnlyDropout(drop.p)
    for name, p in lm.named_parameters():
        adapter = is_adapter_name(name)
        p.requires_grad_(adapter)
        if adapter:
            p.data = p.data.float()
        elif p.dtype != compute_dtype and p.is_floating_point():
            p.data = p.data.to(compute_dtype)  # tied weights share the Parameter: cast once, still tied
    if adapter_dir is not None:
        load_adapter_weights(lm, adapter_dir)
    return len(layers)


def load_adapter_weights(lm: nn.Module, adapter_dir: str | pathlib.Path) -> None:
    """Copy ``adapter_dir/adapter_model.safetensors`` (peft names) into ``lm``'s adapters.

    Raises:
        ValueError: a tensor missing, unknown or of another shape.
    """
    from safetensors.torch import load_file

    saved = load_file(str(pathlib.Path(adapter_dir) / ADAPTER_WEIGHTS))
    ours = {peft_name(name): p for name, p in lm.named_parameters() if is_adapter_name(name)}
    missing, unknown = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    bad = [k for k in ours if k in saved and saved[k].shape != ours[k].shape]
    if missing or unknown or bad:
        raise ValueError(f"{adapter_dir}/{ADAPTER_WEIGHTS} does not match trainer.lora: missing {missing[:3]}, "
                         f"unknown {unknown[:3]}, other shapes {bad[:3]} (rank or target_modules changed?)")
    with torch.no_grad():
        for key, p in ours.items():
            p.copy_(saved[key])


def lora_enabled(policy: nn.Module) -> bool:
    """Whether the policy's HF model carries LoRA adapters (``trainer.lora.rank > 0``)."""
    return hasattr(_lm(policy), "peft_config")


def _peft_config(policy: nn.Module):
    return _lm(policy).peft_config[ADAPTER_NAME]


def adapter_config(policy: nn.Module) -> dict:
    """The JSON-able ``adapter_config.json`` of the policy's adapters, as ``PeftModel.save_pretrained``
    writes it (``r``, ``lora_alpha``, ``target_modules`` sorted, ``lora_dropout``,
    ``base_model_name_or_path``, ``peft_type: "LORA"``, ``task_type: "CAUSAL_LM"``, ...). Not a
    collective."""
    return _config_json(_peft_config(policy))


def _config_json(peft_cfg) -> dict:
    out = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_cfg.to_dict().items()}
    out["inference_mode"] = True  # as save_pretrained writes it
    return json.loads(json.dumps(out, default=str))


def _meta_model(model_path: str) -> nn.Module:
    """The HF model at ``model_path`` built from its config on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


def check_lora_settings(model_path: str, cfg: LoraSettings, ckpt_dir: str | pathlib.Path | None = None,
                        dtype: str | None = None) -> str:
    """Check ``trainer.lora`` against the model at ``model_path`` (its config alone) before a job
    starts and, for ``--resume``, against the checkpoint ``ckpt_dir`` it continues: the adapted
    policy is ``base + (alpha / r) · B A`` on the target modules, so a resume that changed rank,
    alpha, target modules or the base would train one policy while the servers serve another
    (``trainer.lora.dropout`` may change); nor may ``dtype`` (``trainer.dtype``, resolved) differ
    from the base dtype the checkpoint was trained with (``lora_base.json``, when it has one).
    Returns a warning, or ``""``: the checkpoint was trained on another ``model.path`` whose linear
    layers have the same shapes (a moved or another base).

    Raises:
        ValueError: a target module that is no linear layer of the decoder blocks, a rank above
            their widths (``check_rank``), a setting
            that differs from the checkpoint's ``adapter_config.json`` or ``lora_base.json`` (the
            message names both values and the override that resumes it), or a checkpoint adapter
            that does not fit the linear layers of ``model_path`` (the message names the base it
            was trained on).
    """
    lm = _meta_model(model_path)
    targets = resolve_target_modules(lm, cfg.target_modules)
    check_rank(lm, targets, cfg.rank)
    if ckpt_dir is None:
        return ""
    path = pathlib.Path(ckpt_dir) / ADAPTER_CONFIG
    saved = read_adapter_config(ckpt_dir)
    have = {"trainer.lora.rank": saved.get("r"), "trainer.lora.alpha": float(saved.get("lora_alpha") or 0.0),
            "trainer.lora.target_modules": sorted(saved.get("target_modules") or [])}
    want = {"trainer.lora.rank": cfg.rank, "trainer.lora.alpha": lora_alpha(cfg),
            "trainer.lora.target_modules": sorted(targets)}
    changed = [key for key in want if have[key] != want[key]]
    if changed:
        fix = " ".join(f"{key}={_override(have[key])}" for key in changed)
        raise ValueError(f"--resume: the checkpoint {path.parent} was trained with "
                         + ", ".join(f"{key}={have[key]}" for key in changed) + " but this run has "
                         + ", ".join(f"{key}={want[key]}" for key in changed)
                         + f"; the servers would serve another policy than the trainer trains. Resume with "
                           f"{fix}, or start a new run (another name=...) with the new settings")
    trained_dtype = read_base_dtype(path.parent)
    if dtype not in (None, "auto") and trained_dtype is not None and trained_dtype != dtype:
        raise ValueError(f"--resume: the checkpoint {path.parent} was trained with trainer.dtype={trained_dtype} "
                         f"(its {LORA_BASE}) but this run has trainer.dtype={dtype}; its adapters were trained "
                         f"against the base rounded to {trained_dtype}, so the trainer would continue another "
                         f"policy on another base. Resume with trainer.dtype={trained_dtype}, or start a new run "
                         f"(another name=...) with the new settings")
    trained_on = saved.get("base_model_name_or_path")
    adapter_shapes(path.parent)  # a damaged file is named as such, not as another base
    try:
        check_adapter_fits(path.parent, lm)
    except ValueError as exc:
        raise ValueError(f"--resume: the checkpoint {path.parent} does not fit model.path={model_path} ({exc}); "
                         f"it was trained on {trained_on}. Resume with model.path={trained_on}") from None
    if trained_on and pathlib.Path(trained_on).resolve() != pathlib.Path(model_path).resolve():
        return (f"--resume: the checkpoint {path.parent} was trained on {trained_on} but this run has "
                f"model.path={model_path}, whose linear layers have the same shapes: its adapters are applied to "
                f"this base; resume with model.path={trained_on} to continue the run's own policy")
    return ""


def read_adapter_config(adapter_dir: str | pathlib.Path) -> dict:
    """``adapter_dir/adapter_config.json`` as a dict.

    Raises:
        ValueError: the file is missing or is no JSON object (naming it).
    """
    path = pathlib.Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable ({type(exc).__name__}: {exc}); the adapter directory is "
                         f"damaged or incomplete") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not readable (no JSON object); the adapter directory is damaged")
    return config


def read_base_dtype(adapter_dir: str | pathlib.Path) -> str | None:
    """The base dtype ``adapter_dir/lora_base.json`` records (``"bfloat16"``, ...), or ``None``
    without the file (a peft directory written elsewhere).

    Raises:
        ValueError: the file is not readable or names no dtype (naming it).
    """
    path = pathlib.Path(adapter_dir) / LORA_BASE
    if not path.is_file():
        return None
    try:
        dtype = json.loads(path.read_text())["base_dtype"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not readable ({type(exc).__name__}: {exc}); the adapter directory is "
                         f"damaged or incomplete") from None
    if not isinstance(dtype, str):
        raise ValueError(f"{path} is not readable (base_dtype {dtype!r} is no dtype name); the adapter directory "
                         f"is damaged")
    return dtype


def adapter_shapes(adapter_dir: str | pathlib.Path) -> tuple[int | None, dict[str, tuple[int, ...]]]:
    """``(r, {peft name: shape})`` of the peft adapter directory ``adapter_dir``, from its
    ``adapter_config.json`` and its safetensors header (no tensor is read).

    Raises:
        ValueError: a file of ``adapter_dir`` that is missing or not readable (naming it).
    """
    from safetensors import safe_open

    adapter_dir = pathlib.Path(adapter_dir)
    r = read_adapter_config(adapter_dir).get("r")
    try:
        with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as f:
            return r, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError (header, truncation)
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS} is not readable ({type(exc).__name__}: {exc}); the "
                         f"adapter directory is damaged or incomplete") from None


def check_adapter_fits(adapter_dir: str | pathlib.Path, lm: nn.Module) -> None:
    """Check that every tensor of the peft adapter directory ``adapter_dir`` adapts a linear layer
    of the HF model ``lm`` (meta tensors will do) with its shape: ``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]``. Reads the tensors' shapes only (``adapter_shapes``, which raises
    first for an unreadable file).

    Raises:
        ValueError: naming the first tensor that does not fit and the shape it must have.
    """
    r, shapes = adapter_shapes(adapter_dir)
    check_adapter_tensors(dict(lm.named_parameters()), shapes, r)


def _override(value) -> str:
    """``value`` as a command-line override's right-hand side."""
    return f"[{','.join(value)}]" if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)


def initial_adapter(model_path: str, cfg: LoraSettings, dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> tuple[dict[str, Tensor], dict]:
    """The adapter of version 0 for ``trainer.lora`` on the model at ``model_path``, from its
    config alone (the model is built on the meta device: no weights read): ``(tensors, config)``,
    what ``adapter_state_dict`` and ``adapter_config`` give for a fresh policy, save the values:
    ``lora_A`` Kaiming-uniform (``a = sqrt(5)``, peft's init) from a generator seeded ``seed``,
    ``lora_B`` zero, so the adapted model is the base; tensors in ``dtype``, peft names.

    Raises:
        ValueError: bad ``target_modules`` (see ``resolve_target_modules``).
    """
    lm = _meta_model(model_path)
    targets = resolve_target_modules(lm, cfg.target_modules)
    peft_cfg = make_peft_config(cfg, targets, model_path)
    peft_cfg.target_modules = set(targets)  # as add_adapters leaves it
    adapted = re.compile(_block_pattern(targets))  # the modules add_adapters' injection adapts
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in lm.named_modules():
        if isinstance(module, nn.Linear) and adapted.fullmatch(name):
            a = nn.init.kaiming_uniform_(torch.empty(cfg.rank, module.in_features), a=math.sqrt(5), generator=gen)
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.to(dtype)
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = torch.zeros(module.out_features, cfg.rank, dtype=dtype)
    return tensors, _config_json(peft_cfg)


def adapter_parameters(policy: nn.Module) -> Iterator[tuple[str, Tensor | None]]:
    """Yield ``(peft name, full fp32 adapter tensor)`` for every LoRA parameter, in the HF model's
    ``named_parameters`` order (layer by layer; ``lora_A`` before ``lora_B``).

    Collective under FSDP2 (one all-gather per tensor; every rank must iterate to the end), like
    ``policy.full_parameters``: rank 0 gets the tensor on the training device, other ranks
    ``None``. Names: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
    """
    rank = _rank()
    for name, p in _lm(policy).named_parameters():
        if not is_adapter_name(name):
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield peft_name(name), (full.detach() if rank == 0 else None)


def adapter_state_dict(policy: nn.Module) -> dict[str, Tensor] | None:
    """``adapter_parameters`` on CPU, on rank 0 (``None`` elsewhere). Collective."""
    sd = {name: t.cpu() for name, t in adapter_parameters(policy) if t is not None}
    return sd if _rank() == 0 else None


def base_dtype(policy: nn.Module) -> torch.dtype:
    """The dtype the frozen base is stored in (the compute dtype)."""
    for name, p in _lm(policy).named_parameters():
        if not is_adapter_name(name):
            return p.dtype
    return torch.float32


def write_adapter_dir(out_dir: str | pathlib.Path, tensors: dict[str, Tensor], config: dict,
                      stored_dtype: torch.dtype | None = None) -> pathlib.Path:
    """Write a peft adapter directory into the existing ``out_dir``: ``adapter_model.safetensors``
    (``tensors``, peft names), ``adapter_config.json`` (``config``, JSON-ready) and, with
    ``stored_dtype``, ``lora_base.json`` (the base's dtype: during training for a checkpoint, on
    the servers for a disk sync's ``adapters/vN``), which ``launcher.merge_lora`` rounds the base to."""
    from safetensors.torch import save_file

    out_dir = pathlib.Path(out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if stored_dtype is None:
        return out_dir
    (out_dir / LORA_BASE).write_text(json.dumps({"base_model": config.get("base_model_name_or_path"),
                                                 "base_dtype": str(stored_dtype).removeprefix("torch.")}))
    return out_dir


def merged_parameters(policy: nn.Module) -> Iterator[tuple[str, Tensor | None]]:
    """``full_parameters`` of a LoRA policy: ``(hf_name, full tensor)`` of the HF model as if the
    adapters were merged: an adapted weight is ``W + (alpha/r) · B A`` in fp32 (from the base in
    its stored dtype), every other parameter the frozen one in its stored dtype (the compute
    dtype); plain HF names (``...q_proj.weight``), the HF model's order, adapters not listed.
    So a weight sync of full parameters keeps working with LoRA on. Collective like
    ``adapter_parameters``; rank 0 gets the tensors, other ranks ``None``."""
    from peft.tuners.lora import LoraLayer

    lm = _lm(policy)
    rank = _rank()
    scaling = {name: m.scaling[ADAPTER_NAME] for name, m in lm.named_modules() if isinstance(m, LoraLayer)}
    pending: dict[str, dict[str, Tensor | None]] = {}
    for name, p in lm.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        full = full.detach() if rank == 0 else None
        owner, part = _lora_part(name, scaling)
        if owner is None:
            yield name, full
            continue
        if part == "base_layer.bias":
            yield f"{owner}.bias", full
            continue
        pending.setdefault(owner, {})[part] = full
        if len(pending[owner]) == 3:  # base weight, A and B gathered
            parts = pending.pop(owner)
            merged = None
            if rank == 0:
                a, b = parts["lora_A"].float(), parts["lora_B"].float()
                merged = parts["base_layer.weight"].float() + (b @ a) * scaling[owner]
            yield f"{owner}.weight", merged
    assert not pending, f"adapted layers left unmerged: {sorted(pending)}"


def _lora_part(name: str, owners: dict) -> tuple[str | None, str]:
    """``(adapted module's name, part)`` for a parameter of an adapted layer (part:
    ``base_layer.weight``, ``base_layer.bias``, ``lora_A``, ``lora_B``), ``(None, "")`` otherwise."""
    for marker, part in ((".base_layer.weight", "base_layer.weight"), (".base_layer.bias", "base_layer.bias"),
                         (f".lora_A.{ADAPTER_NAME}.weight", "lora_A"), (f".lora_B.{ADAPTER_NAME}.weight", "lora_B")):
        if name.endswith(marker) and name[: -len(marker)] in owners:
            return name[: -len(marker)], part
    return None, ""


def check_checkpoint_kind(ckpt_dir: str | pathlib.Path, rank: int) -> None:
    """Refuse to ``--resume`` a full fine-tuning checkpoint with LoRA on, or a LoRA checkpoint
    (adapters only) with LoRA off (``rank``: this run's ``trainer.lora.rank``).

    Raises:
        ValueError: the checkpoint is of the other kind; the message says what to do instead.
    """
    ckpt = pathlib.Path(ckpt_dir)
    adapters = (ckpt / ADAPTER_WEIGHTS).is_file()
    if rank and not adapters:
        raise ValueError(f"--resume with trainer.lora.rank={rank}: {ckpt} is a full fine-tuning checkpoint (no "
                         f"{ADAPTER_WEIGHTS}); resume it with trainer.lora.rank=0, or start a LoRA run on it "
                         f"as the base (model.path={ckpt}) under another name")
    if not rank and adapters:
        raise ValueError(f"--resume with trainer.lora.rank=0: {ckpt} is a LoRA checkpoint (adapters only); resume "
                         f"it with the run's trainer.lora settings, or merge it (python -m launcher.merge_lora "
                         f"{ckpt} OUT_DIR) and start a run from OUT_DIR")
