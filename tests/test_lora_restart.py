"""A LoRA job's inference server restarted by the launcher with the disk sync (``trainer.weight_sync=disk``,
``trainer.lora.rank > 0``): it starts from the base model with the newest complete
``RUN_DIR/adapters/v{N}`` merged (``--lora-paths``), pinned under ``RUN_DIR/restart_weights``, at
version N (``launcher/servers.py::restart_argv``); before the first adapter, as the job first started.
"""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest

from areal_async.atomic_dir import remove_atomically
from areal_async.config import load_config
from areal_async.devices import free_port
from areal_async.trainer.lora_sync import write_adapter_dir
from launcher.servers import SERVER_ARGV, _server_argv, remove_stale_weights, restart_argv
from tests.support.adapters import GREEDY, adapter_config, adapter_items, assert_serves, peft_policy, step
from tests.support.models import prompt_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OVERRIDES = ["trainer.lora.rank=4", "trainer.weight_sync=disk", "inference.device=cpu", "model.dtype=float32",
             "inference.max_running_requests=4", "inference.base_port=31000"]


def _job(model_dir, port: int = 31000):
    """The config of a LoRA disk job on ``model_dir`` and server 0's ``argv(model, version, adapter)``."""
    cfg = load_config(None, OVERRIDES)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir)))
    inf = cfg.inference
    return cfg, functools.partial(_server_argv, SERVER_ARGV[inf.backend], inf, port, "deterministic", 1, cfg.debug, None)


def _adapter_dir(path, marker: str):
    """A stand-in for a version directory as ``DiskAdapterSender`` leaves it (its two files)."""
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_text(marker)
    (path / "adapter_config.json").write_text("{}")
    return path


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_a_restarted_lora_server_starts_from_the_base_with_the_newest_complete_adapter(tmp_path):
    cfg, argv = _job(tmp_path / "base")
    first = restart_argv(tmp_path, 0, argv, cfg.model, 0, lora=True)  # no adapter yet: as it first started
    assert first == argv(cfg.model, 0) and "--lora-paths" not in first
    ckpt = tmp_path / "checkpoint"  # a resumed job's adapter, at step 4
    assert restart_argv(tmp_path, 0, argv, cfg.model, 4, ckpt, lora=True) == argv(cfg.model, 4, ckpt)
    _adapter_dir(tmp_path / "adapters" / "v5", "five")
    _adapter_dir(tmp_path / "adapters" / "v6.partial", "six, being written")  # write_atomically's staging name
    _adapter_dir(tmp_path / "weights" / "v9", "full weights: not a LoRA job's")
    again = restart_argv(tmp_path, 1, argv, cfg.model, 4, ckpt, lora=True)
    pinned = (tmp_path / "restart_weights" / "server1" / "v5").resolve()
    assert _flag(again, "--lora-paths") == f"policy={pinned}" and _flag(again, "--weight-version") == "5"
    assert _flag(again, "--model-path") == cfg.model.path, "the base model, the adapter merged into it"
    assert again == argv(cfg.model, 5, pinned), "only the adapter and the version change"


def test_a_pinned_adapter_outlives_the_trainers_removal_of_it(tmp_path):
    cfg, argv = _job(tmp_path / "base")
    src = _adapter_dir(tmp_path / "adapters" / "v3", "three")
    cmd = restart_argv(tmp_path, 0, argv, cfg.model, 0, lora=True)
    pinned = tmp_path / "restart_weights" / "server0" / "v3"
    assert _flag(cmd, "--lora-paths") == f"policy={pinned.resolve()}"
    remove_atomically(src)  # the trainer wrote v4 and removed v3 while the server starts
    assert not src.exists()
    assert (pinned / "adapter_model.safetensors").read_text() == "three"
    assert (pinned / "adapter_config.json").read_text() == "{}"


def test_a_new_lora_job_never_restarts_a_server_with_a_stopped_jobs_adapter(tmp_path):
    # a stopped job wrote adapters up to version 7; its checkpoint (what --resume continues) is at step 4
    cfg, argv = _job(tmp_path / "base")
    _adapter_dir(tmp_path / "adapters" / "v7", "seven")
    remove_stale_weights(tmp_path)
    ckpt = tmp_path / "checkpoint"
    assert restart_argv(tmp_path, 0, argv, cfg.model, 4, ckpt, lora=True) == argv(cfg.model, 4, ckpt)


@pytest.mark.timeout(120)
def test_a_restarted_embedded_server_serves_the_newest_adapter_at_its_version(tiny_model_dir, tmp_path):
    """The restart command line run: versions 1 and 2 written, 3 being written, 2 removed by the
    trainer after the pin; the server reports version 2 and serves version 2's greedy tokens."""
    import subprocess

    from areal_async.inference.client import InferenceClient

    policy = peft_policy(tiny_model_dir)
    adapters = tmp_path / "adapters"
    write_adapter_dir(adapters / "v1", dict(adapter_items(policy)()), adapter_config(policy))
    step(policy, seed=5)
    write_adapter_dir(adapters / "v2", dict(adapter_items(policy)()), adapter_config(policy))
    (adapters / "v3.partial").mkdir()
    port = free_port()
    cfg, argv = _job(tiny_model_dir, port)
    cmd = restart_argv(tmp_path, 0, argv, cfg.model, 0, lora=True)
    remove_atomically(adapters / "v2")
    prompt = prompt_ids(tiny_model_dir)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def main():
        async with InferenceClient([f"http://127.0.0.1:{port}"], backoff_s=0.05, probe_timeout_s=2.0) as client:
            await client.wait_healthy(100)
            assert await client.get_weight_version(0) == 2
            async with client._http().post(f"http://127.0.0.1:{port}/generate",
                                           json={"input_ids": prompt, "sampling_params": GREEDY,
                                                 "return_logprob": True}) as r:
                assert r.status == 200
                assert_serves(await r.json(), policy, prompt, 2)

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
