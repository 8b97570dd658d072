"""The LoRA sync's requests and adapter directories against SGLang 0.5.23's own code (``sglang_ref``).

- Every body our client sends for the LoRA sync (``/load_lora_adapter`` with and without the
  ``weight_version`` extension, ``/unload_lora_adapter``, ``/update_weight_version``, and an
  adapter bucket of ``/update_weights_from_distributed`` with its ``lora_name`` / ``config_dict``
  extension), recorded from a fake server, is validated by SGLang's request classes
  (``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``, ``UpdateWeightVersionReqInput``,
  ``UpdateWeightsFromDistributedReqInput``) as FastAPI validates a body, and the values SGLang reads
  are ours (SGLang ignores the extension fields: its schemas drop unknown keys).
- The adapter directory ``write_adapter_dir`` writes is read by SGLang's own loader
  (``LoRAConfig`` + ``LoRAAdapter.initialize_weights``, what ``/load_lora_adapter`` runs on each
  rank): its config, its scaling (the embedded engine's) and its tensors, stacked as SGLang stacks
  them (``qkv_proj``, ``gate_up_proj``), bit-equal to the trainer's.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import torch
from aiohttp import web

from areal_async.embedded.lora import adapter_scale
from areal_async.inference.client import InferenceClient
from areal_async.trainer.lora_sync import DiskAdapterSender, adapter_config_json, write_adapter_dir
from tests.support.fakes import fake_server
from tests.support.sglang_ref import needs_sglang, run_sglang
from tests.support.adapters import adapter_config, adapter_items, peft_policy

pytestmark = [pytest.mark.sglang_ref, needs_sglang]

_SGLANG_SCHEMAS = r"""
import json, sys
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct

out = []
for cls, body in json.load(sys.stdin):
    obj = TypeAdapter(getattr(io_struct, cls)).validate_python(body)  # as FastAPI reads the JSON body
    fields = [f for f in obj.__struct_fields__ if f not in ("rid", "http_worker_ipc", "lora_id")]
    out.append({f: getattr(obj, f) for f in fields})
print(json.dumps(out, default=str))
"""


def _record_bodies(tiny_model_dir, tmp_path) -> list[tuple[str, dict]]:
    """The bodies our client sends: an embedded-style and an SGLang-style disk update, and one
    adapter bucket of the distributed update."""
    seen = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        seen.append((request.path, body))
        if request.path == "/get_weight_version":
            return web.json_response({"weight_version": "0"})
        return web.json_response({"success": True, "message": "", "error_message": None, "loaded_adapters": {}})

    policy = peft_policy(tiny_model_dir)

    async def main():
        async with fake_server(handler) as url, InferenceClient([url]) as client:
            for backend in ("embedded", "sglang"):
                sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 1,
                                           tmp_path / backend, backend=backend)
                await sender.send(7)
            name, tensor = next(iter(adapter_items(policy)()))
            await client.update_weights_from_distributed(0, [name], ["float32"], [list(tensor.shape)], 7,
                                                         adapter=("policy", adapter_config_json(adapter_config(policy))))

    asyncio.run(main())
    return [(path, body) for path, body in seen if path not in ("/pause_generation", "/continue_generation")]


def test_our_lora_requests_read_as_sglangs_request_classes_read_them(tiny_model_dir, tmp_path):
    bodies = _record_bodies(tiny_model_dir, tmp_path)
    classes = {"/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
               "/update_weight_version": "UpdateWeightVersionReqInput",
               "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput"}
    assert [p for p, _ in bodies] == ["/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter",
                                      "/update_weight_version", "/update_weights_from_distributed"]
    read = run_sglang(_SGLANG_SCHEMAS, [[classes[p], b] for p, b in bodies], timeout=240)
    embedded_load, unload, sglang_load, version, bucket = read
    path7 = str((tmp_path / "embedded" / "v7").resolve())
    assert embedded_load == {"lora_name": "policy", "lora_path": path7, "pinned": False}  # weight_version: ignored
    assert bodies[0][1]["weight_version"] == "7"
    assert unload == {"lora_name": "policy"}
    assert sglang_load == {"lora_name": "policy", "lora_path": str((tmp_path / "sglang" / "v7").resolve()),
                           "pinned": False}
    assert "weight_version" not in bodies[2][1]
    assert version == {"new_version": "7", "abort_all_requests": False}
    assert bucket["names"] == bodies[4][1]["names"] and bucket["weight_version"] == "7"
    assert bucket["group_name"] == "weight_update_group" and bucket["load_format"] is None
    assert bodies[4][1]["lora_name"] == "policy" and bodies[4][1]["config_dict"]["r"] == 4


_SGLANG_LOADER = r"""
import base64, json, sys
import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from transformers import AutoConfig

job = json.load(sys.stdin)
set_global_server_args_for_scheduler(ServerArgs(model_path=job["model"], device="cpu"))
config = LoRAConfig(job["adapter"])
adapter = LoRAAdapter("policy", config, AutoConfig.from_pretrained(job["model"]), LoadConfig(), None)
adapter.initialize_weights()  # what /load_lora_adapter runs on each rank
tensors = {n: [list(t.shape), base64.b64encode(t.float().contiguous().numpy().tobytes()).decode()]
           for layer in adapter.layers for n, t in layer.weights.items()}
print(json.dumps({"r": config.r, "lora_alpha": config.lora_alpha, "scaling": adapter.scaling,
                  "target_modules": sorted(config.target_modules), "tensors": tensors}))
"""


def test_sglangs_loader_reads_our_adapter_directory_bit_for_bit(tiny_model_dir, tmp_path):
    policy = peft_policy(tiny_model_dir)
    sent = dict(adapter_items(policy)())
    config = adapter_config_json(adapter_config(policy))
    path = write_adapter_dir(tmp_path / "v1", sent, config)
    out = run_sglang(_SGLANG_LOADER, {"adapter": str(path), "model": str(tiny_model_dir)}, timeout=240)
    assert (out["r"], out["lora_alpha"]) == (config["r"], config["lora_alpha"])
    assert out["scaling"] == adapter_scale(config)  # the embedded engine merges with SGLang's scaling
    assert out["target_modules"] == sorted(config["target_modules"])
    got = {n: torch.frombuffer(bytearray(base64.b64decode(b)), dtype=torch.float32).reshape(s)
           for n, (s, b) in out["tensors"].items()}

    def ours(module: str, ab: str) -> torch.Tensor:
        return sent[f"base_model.model.{module}.lora_{ab}.weight"]

    stacks = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
              "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
    expected = {}
    for layer in range(policy.base_model.model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for fused, parts in stacks.items():
            for ab in "AB":
                expected[f"base_model.model.{prefix}.{fused}.lora_{ab}.weight"] = torch.cat(
                    [ours(f"{prefix}.{p}", ab) for p in parts])
        for single in ("self_attn.o_proj", "mlp.down_proj"):
            for ab in "AB":
                expected[f"base_model.model.{prefix}.{single}.lora_{ab}.weight"] = ours(f"{prefix}.{single}", ab)
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name
    assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"


_SGLANG_READS = r"""
import json, sys
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct

out = []
for cls, body, field in json.load(sys.stdin):
    try:  # FastAPI validates the parsed JSON body in python mode
        out.append([True, getattr(TypeAdapter(getattr(io_struct, cls)).validate_python(body), field)])
    except Exception:
        out.append([False, None])
print(json.dumps(out))
"""

_LOAD = {"lora_name": "policy", "lora_path": "/adapters/v1"}
_BODIES = [("LoadLoRAAdapterReqInput", {**_LOAD, "pinned": v}, "pinned")
           for v in (True, False, "true", "no", 1, 0, 2, "maybe", [True])]
_BODIES += [("LoadLoRAAdapterReqInput", {**_LOAD, key: v}, key)
            for key in ("lora_name", "lora_path") for v in ("x", 5, [], {})]
_BODIES += [("LoadLoRAAdapterReqInput", {"lora_path": "/a"}, "lora_name"),
            ("LoadLoRAAdapterReqInput", {"lora_name": "a"}, "lora_path"),
            ("UnloadLoRAAdapterReqInput", {"lora_name": "policy"}, "lora_name"),
            ("UnloadLoRAAdapterReqInput", {}, "lora_name"),
            ("UnloadLoRAAdapterReqInput", {"lora_name": 3}, "lora_name")]
_BODIES += [("UpdateWeightVersionReqInput", {"new_version": "3", "abort_all_requests": v}, "abort_all_requests")
            for v in (True, "false", 0, "2")]
_BODIES += [("UpdateWeightVersionReqInput", {"abort_all_requests": False}, "new_version")]


def test_the_lora_endpoints_read_bodies_as_sglangs_schemas_do():
    from areal_async.embedded.weight_requests import (parse_load_adapter, parse_unload_adapter,
                                                      parse_weight_version_update)

    def ours(cls: str, body: dict, field: str):
        if cls == "LoadLoRAAdapterReqInput":
            return getattr(parse_load_adapter(body), field)
        if cls == "UnloadLoRAAdapterReqInput":
            return parse_unload_adapter(body)
        version, abort_all = parse_weight_version_update(body)
        return abort_all if field == "abort_all_requests" else version

    sglang = run_sglang(_SGLANG_READS, _BODIES, timeout=240)
    read = []
    for cls, body, field in _BODIES:
        try:
            read.append([True, ours(cls, body, field)])
        except ValueError:
            read.append([False, None])
    # differences by design: none but the empty strings SGLang takes as names (refused here: an
    # adapter needs a name and a path), absent from the table
    assert [(b, s, o) for b, s, o in zip(_BODIES, sglang, read) if s != o] == []
