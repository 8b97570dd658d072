"""A LoRA job on SGLang, as far as it runs without SGLang (docs/lora_sync.md#a-lora-job-on-sglang).

- Config rules: the disk sync and paused updates are required on SGLang, not on the embedded engine.
- Launch: ``launcher.local.run_job``'s server command line carries SGLang's LoRA flags and
  ``--lora-paths policy=RUN_DIR/adapters/v0``, an adapter with the trainer's names, shapes and
  config and ``lora_B`` zero (a resumed job's: its checkpoint); the embedded job's is unchanged.
- Rollout: the worker's and the evaluation's clients name the adapter on SGLang only.
- Sync: the trainer's sender uses SGLang's unload / load / version sequence.
SGLang's own parsing of the same command line and bodies: ``tests/test_lora_sglang_job_ref.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from areal_async.config import LoraConfig, TrainerConfig
from areal_async.inference.client import job_lora_path
from tests.support.lora_jobs import client_kwargs, lora_job, server_argv


def test_lora_on_sglang_needs_the_disk_sync_and_paused_updates(tiny_model_dir, tmp_path):
    lora_job(tiny_model_dir, tmp_path)  # accepted
    with pytest.raises(ValueError, match=r"no distributed LoRA update.*set trainer.weight_sync=disk"):
        lora_job(tiny_model_dir, tmp_path, "trainer.weight_sync=distributed")
    with pytest.raises(ValueError, match=r"reload the previous version; set rollout.interrupt_on_update=true"):
        lora_job(tiny_model_dir, tmp_path, "rollout.interrupt_on_update=false")
    # the embedded engine replaces its merged adapter in one swap, over either sync
    lora_job(tiny_model_dir, tmp_path, "inference.backend=embedded", "trainer.weight_sync=distributed",
             "rollout.interrupt_on_update=false")
    lora_job(tiny_model_dir, tmp_path, "trainer.lora.rank=0", "trainer.weight_sync=distributed")  # full weights


def test_job_lora_path_names_the_adapter_on_sglang_only():
    assert [job_lora_path(b, r) for b in ("sglang", "embedded") for r in (4, 0)] == ["policy", None, None, None]


@pytest.mark.parametrize("overrides, named", [([], "policy"), (["inference.backend=embedded"], None),
                                              (["trainer.lora.rank=0"], None)])
def test_the_rollout_and_evaluation_clients_name_the_adapter_on_sglang(tiny_model_dir, tmp_path, monkeypatch,
                                                                       overrides, named):
    seen = client_kwargs(lora_job(tiny_model_dir, tmp_path, *overrides), monkeypatch)
    assert seen["worker"]["lora_path"] == seen["trainer"]["lora_path"] == named


def _flag(argv: list[str], name: str, n: int = 1) -> list[str]:
    i = argv.index(name)
    return argv[i + 1: i + 1 + n]


def test_the_servers_of_a_lora_job_on_sglang_start_with_the_initial_adapter(tiny_model_dir, tmp_path):
    from areal_async.trainer.lora import adapter_config, adapter_state_dict, initial_adapter
    from areal_async.trainer.policy import build_policy

    cfg = lora_job(tiny_model_dir, tmp_path, "trainer.lora.target_modules=[v_proj,q_proj,down_proj]")
    argv = server_argv(cfg)
    v0 = cfg.run_dir / "adapters" / "v0"
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--enable-lora" in argv
    assert _flag(argv, "--lora-paths") == [f"policy={v0.resolve()}"] and _flag(argv, "--weight-version") == ["0"]
    assert _flag(argv, "--max-lora-rank") == ["4"] and _flag(argv, "--max-loras-per-batch") == ["2"]
    assert _flag(argv, "--lora-target-modules", 4) == ["down_proj", "q_proj", "v_proj", "--lora-paths"]

    tensors = load_file(str(v0 / "adapter_model.safetensors"))
    config = json.loads((v0 / "adapter_config.json").read_text())
    torch.manual_seed(0)
    policy = build_policy(str(tiny_model_dir), TrainerConfig(parallel="ddp", lora=cfg.trainer.lora), torch.device("cpu"))
    fresh = adapter_state_dict(policy)
    assert config == adapter_config(policy)  # what the trainer's sender writes for this policy
    assert sorted(tensors) == sorted(fresh) and all(tensors[n].shape == fresh[n].shape for n in fresh)
    assert all(t.dtype == torch.float32 for t in tensors.values())  # model.dtype
    bs = [n for n in tensors if ".lora_B." in n]
    assert len(bs) == 2 * 3 and all(torch.count_nonzero(tensors[n]) == 0 for n in bs)  # the base model, served
    again, _ = initial_adapter(str(tiny_model_dir), cfg.trainer.lora)
    for name, t in tensors.items():  # A: peft's Kaiming-uniform from a fixed seed, the same at every launch
        assert torch.equal(t, again[name]) and (".lora_B." in name or t.abs().min() > 0), name


def test_a_resumed_lora_job_on_sglang_starts_from_its_checkpoint_adapter(tiny_model_dir, tmp_path):
    import msgspec

    cfg = lora_job(tiny_model_dir, tmp_path)
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, resume=True))
    ckpt = cfg.run_dir / "checkpoint"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3}))
    argv = server_argv(cfg)
    assert _flag(argv, "--lora-paths") == [f"policy={ckpt.resolve()}"] and _flag(argv, "--weight-version") == ["3"]
    assert _flag(argv, "--max-lora-rank") == ["4"] and "--enable-lora" in argv
    assert not (cfg.run_dir / "adapters").exists()


def test_an_embedded_lora_job_starts_its_servers_as_before(tiny_model_dir, tmp_path):
    cfg = lora_job(tiny_model_dir, tmp_path, "inference.backend=embedded")
    argv = server_argv(cfg)
    assert argv[1:3] == ["-m", "areal_async.embedded.server"]
    assert not any(a.startswith("--lora") or a == "--enable-lora" for a in argv)
    assert not (cfg.run_dir / "adapters").exists()


def test_the_trainer_loads_each_adapter_on_sglang_with_its_sequence(tiny_model_dir, tmp_path):
    from areal_async.trainer.lora_sync import DiskAdapterSender
    from areal_async.trainer.main import make_sender
    from areal_async.trainer.policy import build_policy

    policy = build_policy(str(tiny_model_dir), TrainerConfig(parallel="ddp", lora=LoraConfig(rank=4)),
                          torch.device("cpu"))
    for backend in ("sglang", "embedded"):
        cfg = lora_job(tiny_model_dir, tmp_path, f"inference.backend={backend}")
        sender = make_sender(cfg, policy, None, cfg.run_dir, torch.device("cpu"))
        assert isinstance(sender, DiskAdapterSender) and sender.backend == backend
        assert sender.adapters_dir == cfg.run_dir / "adapters" and sender.lora_name == "policy"
