"""Process group, device and the data-parallel wrapping of the policy (FSDP2 or DDP).

FSDP2 (also with gloo on CPU): each decoder layer is a unit and ``PackedPolicy`` the root;
``trainer.parallel: ddp`` keeps full replicas. Weights, gradients and optimizer state are fp32;
``trainer.dtype`` is the compute dtype. With LoRA (``trainer.lora``, ``trainer/lora.py``) the base
is frozen and stored in the compute dtype, and only the fp32 adapters are trained. ``trainer.compile`` compiles each decoder layer's
``forward`` and the head's chunks. ``full_parameters`` and ``full_state_dict`` are collectives, and
only rank 0 gets the tensors. docs/trainer.md#data-parallelism-fsdp2-with-gloo-works-on-cpu and
the sections after it.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM

from areal_async.batch_invariant import make_linears_batch_invariant
from areal_async.config import LORA_COMPILE_RULE, TrainerConfig
from areal_async.determinism import check_compile
from areal_async.devices import free_port
from areal_async.dtypes import FLOAT_DTYPES, dtype_from_name
from areal_async.tcp_store import hosted_store
from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.lora import add_adapters, lora_enabled, merged_parameters
from areal_async.trainer.packed_policy import PackedPolicy

# trainer.dtype's choices (config.TrainerConfig; "auto" is resolved before): no float16 compute
_COMPUTE_DTYPES = {name: FLOAT_DTYPES[name] for name in ("float32", "bfloat16")}


def init_distributed(device: str, timeout_s: float = 1800.0) -> torch.device:
    """Join the torchrun default group (gloo on CPU, NCCL on CUDA) and return this rank's device.

    ``device``: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``. Without torchrun's
    environment (``RANK`` unset) a single-rank group is created on a free local port, its store
    listening on 127.0.0.1 only (``tcp_store.hosted_store``).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    store = None
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        store = hosted_store("127.0.0.1", int(os.environ["MASTER_PORT"]), 1,
                             datetime.timedelta(seconds=timeout_s), multi_tenant=False)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = {} if store is None else {"store": store, "rank": 0, "world_size": 1}
    dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None, **rank)
    return dev


def _fused_rms_norm(module: torch.nn.Module, x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


@functools.cache
def _fused_norm_class(cls: type) -> type:
    """``cls`` with ``forward`` = ``F.rms_norm`` (one subclass per norm class)."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_rms_norm, "fused_rms_norm": True})


def use_fused_rms_norm(model: torch.nn.Module) -> int:
    """Make every HF RMSNorm module (``variance_epsilon`` + ``weight``) compute with
    ``F.rms_norm``: one fused kernel each way on CUDA instead of ~8 element-wise ones, fp32
    inside and one rounding (HF rounds the normalised value, then multiplies by the weight).
    Row-wise, so batch invariance is kept. Returns how many modules were changed (idempotent).

    The module's class is swapped for a subclass (parameters, names and ``isinstance`` stay):
    every norm then runs the same ``forward``, so a compiled decoder layer's guards hold for all
    layers (a per-module ``forward`` attribute would recompile each layer)."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and not getattr(
                cls, "fused_rms_norm", False):
            module.__class__ = _fused_norm_class(cls)
            count += 1
    return count


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Make every decoder layer (``model.model.layers``) call its own ``forward`` compiled with
    ``torch.compile`` (an instance attribute; ``del layer.forward`` undoes it). Returns how many.
    Before or after ``fully_shard``: FSDP2 works through module hooks, outside ``forward``."""
    layers = model.model.layers
    for layer in layers:
        layer.forward = torch.compile(type(layer).forward.__get__(layer))
    return len(layers)


def build_policy(model_path: str, cfg: TrainerConfig, device: torch.device,
                 batch_invariant: bool = False, adapter_dir: str | None = None) -> PackedPolicy | torch.nn.Module:
    """Load the HF model in fp32, switch it to packed attention and shard/replicate it, computing
    in ``cfg.dtype``. ``batch_invariant`` (deterministic mode): every linear computes in fixed row
    tiles, so a sequence's log-probs do not depend on what else is packed with it.

    ``cfg.lora.rank > 0``: LoRA adapters are injected first (``trainer/lora.py``; ``model_path``
    is then the base model), the rest frozen and stored in ``cfg.dtype``; ``adapter_dir``: a
    LoRA checkpoint whose adapters are loaded (``--resume``).

    Every rank loads the full checkpoint (small models; a meta-device init would avoid that).

    Raises:
        ValueError: ``cfg.compile`` together with ``batch_invariant`` or with LoRA; bad
            ``cfg.lora.target_modules``.
    """
    check_compile(cfg.compile, batch_invariant)
    if cfg.lora.rank and cfg.compile:
        raise ValueError(LORA_COMPILE_RULE)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank clutters the job's console
    compute_dtype = dtype_from_name(cfg.dtype, _COMPUTE_DTYPES, "trainer.dtype")
    # LoRA: the frozen base is loaded straight in the compute dtype (a bf16 base never exists in fp32)
    load_dtype = compute_dtype if cfg.lora.rank else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=load_dtype).to(device)
    lm.config.use_cache = False
    if cfg.lora.rank:  # before anything replaces a linear's forward: the adapters' linears are tiled too
        add_adapters(lm, cfg.lora, model_path, compute_dtype, adapter_dir)
    use_packed_attention(lm, backend=cfg.attention_backend)
    if device.type == "cuda":
        use_fused_rms_norm(lm)
    if batch_invariant:
        make_linears_batch_invariant(lm)
    if cfg.compile:
        compile_decoder_layers(lm)
    if cfg.activation_checkpointing:
        checkpoint_decoder_layers(lm)
    if cfg.parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = PackedPolicy(lm, compile_head=cfg.compile)
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for layer in lm.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(policy, mp_policy=mp_policy)
        return policy
    policy = PackedPolicy(lm, autocast_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                          compile_head=cfg.compile)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return policy
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(policy, device_ids=device_ids)


def checkpoint_decoder_layers(lm: torch.nn.Module) -> None:
    """Wrap each decoder layer's forward in ``torch.utils.checkpoint`` (non-reentrant, RNG state
    kept, so LoRA dropout masks replay): while grad is enabled a layer keeps only its inputs and
    runs its forward again in the backward pass. Log-probs and gradients are unchanged."""
    from torch.utils.checkpoint import checkpoint

    for layer in lm.model.layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def hf_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM inside a (possibly DDP-wrapped) ``PackedPolicy``."""
    inner = policy.module if isinstance(policy, torch.nn.parallel.DistributedDataParallel) else policy
    return inner.lm


def full_parameters(policy: torch.nn.Module) -> Iterator[tuple[str, Tensor | None]]:
    """Yield ``(hf_name, full tensor)`` for each parameter, in ``named_parameters`` order.

    Collective under FSDP2 (one all-gather per parameter; every rank must iterate to the end).
    Rank 0 gets the full tensor on the training device; other ranks get ``None``. Names are the
    HF ones (``model.layers.0.self_attn.q_proj.weight``); tied weights appear once. With LoRA
    (``trainer/lora.py``): the HF model's parameters with the adapters merged in (adapted weights fp32, the
    rest in the compute dtype it is stored in), under the same names (``lora.merged_parameters``).
    """
    if lora_enabled(policy):
        yield from merged_parameters(policy)
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, p in hf_model(policy).named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, (full.detach() if rank == 0 else None)


def trainable_parameters(policy: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them in full fine-tuning, the adapters with LoRA."""
    return [p for p in policy.parameters() if p.requires_grad]


def full_state_dict(policy: torch.nn.Module) -> dict[str, Tensor] | None:
    """The HF model's parameters, full, on CPU on rank 0 (``None`` elsewhere). Collective.

    Llama/Qwen checkpoints have no persistent buffers (rotary tables are recomputed), so the
    parameters are the whole checkpoint.
    """
    sd = {name: t.cpu() for name, t in full_parameters(policy) if t is not None}
    return sd if (not dist.is_initialized() or dist.get_rank() == 0) else None
