"""A LoRA job's SGLang servers and rollout against SGLang 0.5.23's own code (``sglang_ref``).

- The launcher's server command line (``launcher.local.run_job``) goes through SGLang's
  ``prepare_server_args`` (its argparse), ``resolve_once`` and ``check_server_args`` (with its LoRA
  checks), as ``sglang.launch_server`` runs them: LoRA is on, ``policy`` is loaded from the
  version-0 adapter, the rank and target modules admit the adapter (SGLang's
  ``LoRAMemoryPool.can_support``, taken from its source, and the target check of
  ``LoRAManager.init_lora_shapes``).
- That adapter through SGLang's loader (``LoRAConfig`` + ``LoRAAdapter.initialize_weights``):
  ``lora_B`` zero, so the served model is the base.
- The rollout worker's ``/generate`` bodies (a first one and one resubmitted after an abort)
  name the adapter and pass SGLang's ``GenerateReqInput`` and its contract gate.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tests.support.fakes import SGLANG_ABORTED, SGLANG_FINISHED, fake_server
from tests.support.lora_jobs import client_kwargs, lora_job, server_argv
from tests.support.sglang_ref import needs_sglang, run_sglang

pytestmark = [pytest.mark.sglang_ref, needs_sglang]

_SGLANG_LAUNCH = r"""
import ast, json, sys, types, typing
import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora import lora_config
from sglang.srt.lora.utils import get_normalized_target_modules
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler
from transformers import AutoConfig

argv = json.load(sys.stdin)
args = prepare_server_args(argv)  # what sglang.launch_server does with its argv
args.resolve_once()
args.check_server_args()  # the LoRA checks: --lora-paths parsed into LoRARefs
cfg = resolving_view(args)
[ref] = cfg.lora_paths
server_targets = get_normalized_target_modules(cfg.lora_target_modules)

set_global_server_args_for_scheduler(ServerArgs(model_path=cfg.model_path, device="cpu"))
config = LoRAConfig(ref.lora_path)
adapter = LoRAAdapter(ref.lora_name, config, AutoConfig.from_pretrained(cfg.model_path), LoadConfig(), None)
adapter.initialize_weights()  # what loading an adapter runs on each rank
# LoRAMemoryPool.can_support, from mem_pool.py's source (importing that module needs einops and
# the MoE layers, which .venv-sglang does not hold), bound to a pool of the server's sizes
source = open(lora_config.__file__.replace("lora_config.py", "mem_pool.py")).read()
pool_cls = next(c for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == "LoRAMemoryPool")
can_support_def = next(n for n in pool_cls.body if isinstance(n, ast.FunctionDef) and n.name == "can_support")
namespace = {"Union": typing.Union, "Iterable": typing.Iterable, "LoRAConfig": LoRAConfig,
             "get_normalized_target_modules": get_normalized_target_modules}
exec(compile(ast.Module([can_support_def], []), "mem_pool.py", "exec"), namespace)
pool = types.SimpleNamespace(max_lora_rank=cfg.max_lora_rank, lora_added_tokens_size=0, target_modules=server_targets)
weights = {n: t for layer in adapter.layers for n, t in layer.weights.items()}
print(json.dumps({
    "enable_lora": cfg.enable_lora, "lora": [ref.lora_name, ref.lora_path], "max_lora_rank": cfg.max_lora_rank,
    "max_loras_per_batch": cfg.max_loras_per_batch, "weight_version": cfg.weight_version,
    "r": config.r, "can_support": namespace["can_support"](pool, config),
    "targets_covered": get_normalized_target_modules(config.target_modules) <= server_targets,
    "b_nonzero": sum(int(torch.count_nonzero(t)) for n, t in weights.items() if "lora_B" in n),
    "a_nonzero": sum(int(torch.count_nonzero(t)) for n, t in weights.items() if "lora_A" in n),
    "b_tensors": sum("lora_B" in n for n in weights)}))
"""


@pytest.mark.parametrize("targets, rank", [("all-linear", 4), ("[q_proj,v_proj]", 8)])
def test_sglang_starts_the_launchers_lora_server_with_the_zero_adapter(tiny_model_dir, tmp_path, targets, rank):
    cfg = lora_job(tiny_model_dir, tmp_path, f"trainer.lora.rank={rank}", f"trainer.lora.target_modules={targets}")
    argv = server_argv(cfg)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    # --device cpu: SGLang's resolution asks for an accelerator when none is named, and here is none
    out = run_sglang(_SGLANG_LAUNCH, [*argv[3:], "--device", "cpu"], timeout=300)
    v0 = str((cfg.run_dir / "adapters" / "v0").resolve())
    assert out["enable_lora"] is True and out["lora"] == ["policy", v0] and out["weight_version"] == "0"
    assert out["max_lora_rank"] == rank == out["r"] and out["max_loras_per_batch"] == 2
    assert out["can_support"] and out["targets_covered"]
    layers = 2
    # per layer, stacked as SGLang stacks them: qkv, o, gate_up, down; q and v: qkv only
    assert out["b_tensors"] == layers * (4 if targets == "all-linear" else 1)
    assert out["b_nonzero"] == 0 and out["a_nonzero"] > 0


_SGLANG_GENERATE = r"""
import json, sys
import pydantic
from sglang.api.v1.api_types import GenerateRequest
from sglang.srt.managers.io_struct import GenerateReqInput

out = []
for body in json.load(sys.stdin):
    obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)  # as FastAPI reads the body
    GenerateRequest.from_json_value(body)
    obj.normalize_batch_and_arguments()
    out.append(obj.lora_path)
print(json.dumps(out))
"""


def test_the_rollouts_generate_bodies_name_the_adapter_as_sglang_reads_them(tiny_model_dir, tmp_path, monkeypatch):
    from areal_async.inference.client import InferenceClient

    cfg = lora_job(tiny_model_dir, tmp_path)
    kwargs = client_kwargs(cfg, monkeypatch)["worker"]  # the rollout worker's client, as it builds it
    monkeypatch.undo()
    replies, bodies = [SGLANG_ABORTED, SGLANG_FINISHED], []

    async def handler(request: web.Request) -> web.Response:
        if request.path != "/generate":
            return web.json_response({})
        bodies.append(await request.json())
        return web.json_response(replies[len(bodies) - 1])

    async def main():
        async with fake_server(handler) as url, InferenceClient([url], **{**kwargs, "health_check_interval_s": None}) as c:
            sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop_token_ids": [2]}
            await c.generate([1, 2, 3], sampling, rid="g0-0")

    asyncio.run(main())
    assert kwargs["lora_path"] == "policy" and len(bodies) == 2  # the first, and the one resubmitted after the abort
    assert run_sglang(_SGLANG_GENERATE, bodies, timeout=240) == ["policy", "policy"]
