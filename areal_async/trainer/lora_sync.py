"""Adapter-only weight sync: each policy version sends a LoRA adapter's tensors, not the model.

Two ``WeightSender``s (``weight_sync.py``'s seam), fed by arguments rather than the policy, so
the trainer's LoRA module plugs in without this module knowing peft's wrapping:

- ``items``: a zero-argument callable yielding ``(peft name, full tensor or None)``, collective over
  the trainer's ranks (``None`` on ranks other than 0), names as ``get_peft_model_state_dict``
  gives them (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``);
- ``config``: the adapter's ``adapter_config.json`` content (a dict, or a zero-argument callable
  returning it, called on rank 0).

``DistributedAdapterSender`` broadcasts the adapter over the weight-update group of
``DistributedWeightSender`` (same group, rebuilds and dead-server handling), each bucket's
``/update_weights_from_distributed`` call carrying ``lora_name`` and ``config_dict`` (the embedded
server's extension; SGLang 0.5.23 has no distributed LoRA update). ``DiskAdapterSender`` writes a
peft adapter directory ``adapters_dir/v{N}/`` atomically and has each live server load it through
SGLang's ``/load_lora_adapter``, with ``lora_base.json`` (the servers' base dtype) beside it for
``launcher.merge_lora``. Every version sends the whole adapter, so a restarted server is
brought up to date by the next update (with the disk sync the launcher starts it with the newest
adapter already). ``update_bytes`` is what one update moves. Decisions, names and endpoints:
docs/lora_sync.md.
"""

from __future__ import annotations

import asyncio
import math
import pathlib
from collections.abc import Callable, Iterable

import torch

from areal_async.atomic_dir import remove_atomically, write_atomically
from areal_async.inference.client import LORA_NAME, ServerError
from areal_async.trainer import lora
from areal_async.trainer.weight_sync import DistributedWeightSender, _rank

AdapterItems = Callable[[], Iterable[tuple[str, "torch.Tensor | None"]]]


def adapter_config_json(config) -> dict:
    """``config`` (a dict or a callable returning one) as JSON-ready data: peft's sets (e.g.
    ``target_modules``) become sorted lists."""
    config = config() if callable(config) else config

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dict(config))


def write_adapter_dir(out_dir: pathlib.Path, tensors: dict[str, torch.Tensor], config: dict,
                      base_dtype: torch.dtype | None = None) -> pathlib.Path:
    """Write a peft adapter directory (``adapter_model.safetensors``, ``adapter_config.json``:
    what ``PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read; with
    ``base_dtype``, ``lora_base.json``: the dtype the servers hold the base in, which
    ``launcher.merge_lora`` rounds the base to) atomically (``atomic_dir.write_atomically``; the
    files: ``lora.write_adapter_dir``); returns ``out_dir``."""
    out_dir = pathlib.Path(out_dir)
    with write_atomically(out_dir) as staging:
        lora.write_adapter_dir(staging, tensors, adapter_config_json(config), base_dtype)
    return out_dir


class DistributedAdapterSender(DistributedWeightSender):
    """``DistributedWeightSender`` over an adapter's tensors (module docstring).

    Args:
        items, config: the adapter (module docstring).
        client, num_servers, master_address, master_port, bucket_bytes, device,
            interrupt_on_update: as ``DistributedWeightSender``'s.
        send_dtype: dtype of the broadcast adapter tensors; float32 by default (the trainer's
            LoRA parameters, bit for bit: the servers merge them in float32).
        lora_name: the adapter's name on the servers.
    """

    def __init__(self, items: AdapterItems, config, client, num_servers: int, master_address: str,
                 master_port: int, bucket_bytes: int, device: torch.device, send_dtype: torch.dtype = torch.float32,
                 interrupt_on_update: bool = True, lora_name: str = LORA_NAME):
        super().__init__(None, client, num_servers, master_address, master_port, bucket_bytes, send_dtype, device,
                         interrupt_on_update)
        self.items, self.config, self.lora_name = items, config, lora_name
        self._config_json: dict | None = None

    def _named_tensors(self):
        return self.items()

    async def _announce(self, server: int, names: list[str], dtypes: list[str], shapes: list[list[int]],
                        version: int):
        if self._config_json is None:
            self._config_json = adapter_config_json(self.config)
        return await self.client.update_weights_from_distributed(server, names, dtypes, shapes, version,
                                                                 self.group_name,
                                                                 adapter=(self.lora_name, self._config_json))


class DiskAdapterSender:
    """Write a peft adapter directory per version and have each live server load it.

    Args:
        items, config: the adapter (module docstring).
        client: ``InferenceClient`` or a stand-in on rank 0, ``None`` elsewhere.
        num_servers: number of inference servers.
        adapters_dir: where ``v{version}/`` adapter directories are written, readable by the
            servers: ``RUN_DIR/adapters``, where the launcher finds the newest for a restarted server.
        save_dtype: dtype of the written adapter tensors (float32: the trainer's, bit for bit).
        base_dtype: the dtype the servers hold the base in (``model.dtype``), written as each
            directory's ``lora_base.json`` so that ``launcher.merge_lora`` of it gives the merged
            weights the servers served.
        interrupt_on_update: pause the servers (mode ``abort``) around the load.
        lora_name: the adapter's name on the servers.
        backend: ``"embedded"``: one ``/load_lora_adapter`` with ``weight_version`` (replaces the
            adapter and moves the version in one swap); ``"sglang"``: ``/unload_lora_adapter``,
            ``/load_lora_adapter``, ``/update_weight_version`` (SGLang refuses a loaded name and
            its load carries no version), which needs ``interrupt_on_update``.

    Raises:
        ValueError: ``backend`` unknown, or ``"sglang"`` without ``interrupt_on_update`` (between
            its unload and its load a request naming the adapter would reload the old one).
    """

    def __init__(self, items: AdapterItems, config, client, num_servers: int, adapters_dir: pathlib.Path,
                 save_dtype: torch.dtype = torch.float32, interrupt_on_update: bool = True,
                 lora_name: str = LORA_NAME, backend: str = "embedded", base_dtype: torch.dtype = torch.float32):
        if backend not in ("embedded", "sglang"):
            raise ValueError(f"backend {backend!r} is not 'embedded' or 'sglang'")
        if backend == "sglang" and not interrupt_on_update:
            raise ValueError("the LoRA disk sync to SGLang unloads and loads the adapter: generation must be paused "
                             "around it (rollout.interrupt_on_update=true)")
        self.items, self.config, self.client, self.num_servers = items, config, client, num_servers
        self.adapters_dir, self.save_dtype, self.base_dtype = pathlib.Path(adapters_dir), save_dtype, base_dtype
        self.interrupt_on_update, self.lora_name, self.backend = interrupt_on_update, lora_name, backend
        self._previous: pathlib.Path | None = None

    async def setup(self) -> None:
        return None

    async def send(self, version: int) -> None:
        tensors = {}
        for name, full in self.items():  # collective: every rank takes part
            if full is not None:
                tensors[name] = full.detach().to(device="cpu", dtype=self.save_dtype)
        if _rank() != 0:
            return
        path = await asyncio.to_thread(write_adapter_dir, self.adapters_dir / f"v{version}", tensors, self.config,
                                       self.base_dtype)
        await self.client.servers.probe(require_version=False)  # a restarted server gets this version too
        if self.interrupt_on_update:
            await self.client.pause()
        try:
            await self.client.each_live(lambda i: self._load(i, str(path.resolve()), version))
        finally:
            if self.interrupt_on_update:
                await self.client.continue_generation()
        if self._previous is not None and self._previous != path:
            remove_atomically(self._previous)
        self._previous = path

    async def _load(self, server: int, path: str, version: int) -> None:
        if self.backend == "embedded":
            await self.client.load_lora_adapter(server, self.lora_name, path, version)
            return
        try:
            await self.client.unload_lora_adapter(server, self.lora_name)
        except ServerError as exc:  # none loaded yet (the first version, a restarted server); a real
            if exc.status != 400:   # failure shows as the load's "already loaded"
                raise
        await self.client.load_lora_adapter(server, self.lora_name, path)
        await self.client.update_weight_version(server, version)


# ---- bytes per update ----------------------------------------------------------------------------

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def update_bytes(model_config, r: int, target_modules: Iterable[str] = ALL_LINEAR,
                 adapter_dtype: torch.dtype = torch.float32, full_dtype: torch.dtype | None = None) -> dict:
    """What one weight update sends for ``model_config`` (an HF config), measured on a model built
    on the meta device (no memory): ``{"full": bytes of every parameter in full_dtype (default: the
    config's dtype, else bfloat16), "adapter": bytes of the rank-``r`` LoRA tensors of the linears
    whose name ends in one of ``target_modules``, in adapter_dtype; "adapter_params", "full_params",
    "ratio": full / adapter}``. Tied weights count once, as a full update sends them.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    if full_dtype is None:
        declared = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
        full_dtype = getattr(torch, declared) if isinstance(declared, str) else (declared or torch.bfloat16)
    full_params = sum(p.numel() for p in model.parameters())  # remove_duplicate: tied once
    targets = tuple(target_modules)
    adapter_params = sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    full = full_params * full_dtype.itemsize
    adapter = adapter_params * adapter_dtype.itemsize
    return {"full": full, "adapter": adapter, "full_params": full_params, "adapter_params": adapter_params,
            "ratio": full / adapter if adapter else math.inf}
