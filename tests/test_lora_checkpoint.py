"""LoRA checkpoints (adapter-only), ``--resume`` from one, and ``launcher.merge_lora``.

A LoRA checkpoint is a peft adapter directory plus the usual training state
(docs/lora.md#checkpoints): resumed, the next step is bit for bit the unbroken run's (fp32 on
CPU, same packing, so the same arithmetic); merged, the HF checkpoint's logits equal peft's
``PeftModel`` on the same adapter within fp32 rounding (1e-5 absolute on logits of size ~1).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from areal_async.config import load_config
from tests.support import REPO
from tests.support.batches import make_trajectories, shared_prefix_trajectories

CPU = torch.device("cpu")


def _config(model_dir, *extra: str):
    return load_config(None, [f"model.path={model_dir}", "trainer.lora.rank=4", "trainer.lora.dropout=0.1",
                              "trainer.parallel=ddp", "trainer.max_tokens_per_mb=24", "trainer.warmup_steps=2",
                              "trainer.lr=1e-3", *extra])


def _learner(cfg, adapter_dir=None):
    """What ``Learner`` builds on one rank (without its process group): policy, AdamW, schedule."""
    from areal_async.trainer.policy import build_policy, trainable_parameters
    from areal_async.trainer.schedule import make_scheduler

    t = cfg.trainer
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model.path, t, CPU, adapter_dir=adapter_dir)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    return policy, optimizer, make_scheduler(optimizer, t)


def _step(cfg, run, k: int) -> dict:
    from areal_async.trainer.step import train_step

    policy, optimizer, scheduler = run
    trajs = (make_trajectories, shared_prefix_trajectories)[k % 2](384, seed=k)
    metrics = train_step(policy, optimizer, trajs, cfg.algo, cfg.trainer, 1.0, CPU, version=k)
    scheduler.step()
    return metrics


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_exactly(tiny_model_dir, tmp_path):
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.lora import adapter_config, adapter_state_dict
    from areal_async.trainer.resume import load_training_state, read_step

    torch.set_num_threads(1)
    cfg = _config(tiny_model_dir)
    unbroken = _learner(cfg)
    want = [_step(cfg, unbroken, k) for k in range(3)]
    stopped = _learner(cfg)
    for k in range(2):
        assert _step(cfg, stopped, k) == want[k]
    save_checkpoint(cfg, *stopped, tmp_path, 2, [])
    ckpt = tmp_path / "checkpoint"
    assert read_step(ckpt) == 2
    files = sorted(p.name for p in ckpt.iterdir())
    assert "model.safetensors" not in files and {"adapter_model.safetensors", "adapter_config.json",
                                                 "trainer_state.pt", "trainer_state.json"} <= set(files)
    assert json.loads((ckpt / "adapter_config.json").read_text()) == adapter_config(stopped[0])
    # the optimizer state is the adapters' only: much smaller than the model
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < model_bytes

    resumed = _learner(cfg, adapter_dir=str(ckpt))
    assert load_training_state(*resumed, ckpt) == 2
    saved, loaded = adapter_state_dict(stopped[0]), adapter_state_dict(resumed[0])
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert _step(cfg, resumed, 2) == want[2]  # dropout's RNG, AdamW's moments, the lr: all continue
    final, got = adapter_state_dict(unbroken[0]), adapter_state_dict(resumed[0])
    assert all(torch.equal(final[k], got[k]) for k in final)


def test_a_resume_refuses_an_adapter_of_another_shape(tiny_model_dir, tmp_path):
    from areal_async.trainer.learner import save_checkpoint

    cfg = _config(tiny_model_dir)
    save_checkpoint(cfg, *_learner(cfg), tmp_path, 0, [])
    with pytest.raises(ValueError, match="does not match trainer.lora"):
        _learner(_config(tiny_model_dir, "trainer.lora.rank=8"), adapter_dir=str(tmp_path / "checkpoint"))


def test_a_resume_with_another_alpha_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    # A resume with trainer.lora.alpha changed used to run: the servers merged the checkpoint at the
    # old alpha / r, the trainer trained at the new one (|Δ log-prob| 3.5 at staleness 0).
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.lora import check_lora_settings
    from launcher.local import prepare_run

    cfg = _config(tiny_model_dir)  # rank 4, alpha 0 (= 8), all-linear
    save_checkpoint(cfg, *_learner(cfg), tmp_path / "exp", 1, [])
    ckpt = tmp_path / "exp" / "checkpoint"
    check_lora_settings(str(tiny_model_dir), _config(tiny_model_dir, "trainer.lora.alpha=8").trainer.lora, ckpt)
    check_lora_settings(str(tiny_model_dir), _config(tiny_model_dir, "trainer.lora.dropout=0.0").trainer.lora, ckpt)
    with pytest.raises(ValueError, match=r"trained with trainer.lora.alpha=8.0 but this run has "
                                         r"trainer.lora.alpha=32.0.*Resume with trainer.lora.alpha=8, "):
        check_lora_settings(str(tiny_model_dir), _config(tiny_model_dir, "trainer.lora.alpha=32").trainer.lora, ckpt)
    with pytest.raises(ValueError, match=r"Resume with trainer.lora.target_modules=\[.*o_proj.*\]"):
        check_lora_settings(str(tiny_model_dir),
                            _config(tiny_model_dir, "trainer.lora.target_modules=[q_proj]").trainer.lora, ckpt)
    launch = load_config("configs/quickstart_cpu.yaml", [f"model.path={tiny_model_dir}", f"run_root={tmp_path}",
                                                         "name=exp", "inference.num_servers=1", "trainer.total_steps=3",
                                                         "trainer.lora.rank=4", "trainer.lora.alpha=16"])
    with pytest.raises(ValueError, match="trainer.lora.alpha=8.0 but this run has trainer.lora.alpha=16.0"):
        prepare_run(launch, overwrite=False, resume=True)


def test_a_resume_with_another_trainer_dtype_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    # a resume with trainer.dtype changed used to run: the adapters, trained against the base
    # rounded to the checkpoint's dtype (lora_base.json), went on training on another base
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.lora import check_lora_settings
    from launcher.local import prepare_run

    cfg = _config(tiny_model_dir, "trainer.dtype=float32")
    save_checkpoint(cfg, *_learner(cfg), tmp_path / "exp", 1, [])
    ckpt = tmp_path / "exp" / "checkpoint"
    assert json.loads((ckpt / "lora_base.json").read_text())["base_dtype"] == "float32"
    launch = load_config("configs/quickstart_cpu.yaml", [f"model.path={tiny_model_dir}", f"run_root={tmp_path}",
                                                         "name=exp", "inference.num_servers=1", "trainer.total_steps=3",
                                                         "trainer.lora.rank=4", "trainer.dtype=bfloat16"])
    with pytest.raises(ValueError, match=r"trained with trainer.dtype=float32 \(its lora_base.json\) but this run "
                                         r"has trainer.dtype=bfloat16.*Resume with trainer.dtype=float32, "):
        prepare_run(launch, overwrite=False, resume=True)
    assert check_lora_settings(str(tiny_model_dir), cfg.trainer.lora, ckpt, "float32") == ""
    with pytest.raises(ValueError, match=r"Resume with trainer.dtype=float32, or start a new run"):
        check_lora_settings(str(tiny_model_dir), cfg.trainer.lora, ckpt, "bfloat16")
    (ckpt / "lora_base.json").unlink()  # a checkpoint written before lora_base.json: not checked
    assert check_lora_settings(str(tiny_model_dir), cfg.trainer.lora, ckpt, "bfloat16") == ""


def _wider_model(model_dir, out_dir):
    """``model_dir``'s model with twice its MLP width (random weights, the same tokenizer)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def test_a_resume_on_another_base_is_refused_or_warned_before_anything_starts(tiny_model_dir, tmp_path):
    # a resume with model.path changed used to pass the launch checks: an adapter that does not fit
    # the new base failed only in the server's start-up traceback, one that fits was applied silently
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.lora import check_lora_settings
    from launcher.local import prepare_run

    wide = _wider_model(tiny_model_dir, tmp_path / "wide")
    cfg = _config(wide)
    save_checkpoint(cfg, *_learner(cfg), tmp_path / "exp", 1, [])
    ckpt = tmp_path / "exp" / "checkpoint"
    assert check_lora_settings(str(wide), cfg.trainer.lora, ckpt) == ""
    with pytest.raises(ValueError, match=rf"does not fit model.path={tiny_model_dir}.*down_proj.*trained on "
                                         rf"{wide}.*Resume with model.path={wide}"):
        check_lora_settings(str(tiny_model_dir), cfg.trainer.lora, ckpt)
    launch = load_config("configs/quickstart_cpu.yaml", [f"model.path={tiny_model_dir}", f"run_root={tmp_path}",
                                                         "name=exp", "inference.num_servers=1", "trainer.total_steps=3",
                                                         "trainer.lora.rank=4"])
    with pytest.raises(ValueError, match="does not fit model.path"):
        prepare_run(launch, overwrite=False, resume=True)
    same_shapes = shutil.copytree(wide, tmp_path / "wide-copy")
    warning = check_lora_settings(str(same_shapes), cfg.trainer.lora, ckpt)
    assert f"trained on {wide}" in warning and f"model.path={same_shapes}" in warning, warning


def test_merge_lora_refuses_an_out_dir_that_would_replace_data(tmp_path):
    # merge_lora RUN/checkpoint RUN used to replace the whole run directory with the merged model
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (ckpt / name).write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep").write_text("x")
    from launcher.merge_lora import merge

    cases = [(ckpt, "is the adapter directory"), (ckpt / "sub", "lies inside the adapter directory"),
             (tmp_path / "other", "exists and is not empty")]
    for out, words in cases:
        with pytest.raises(ValueError, match=words):
            merge(ckpt, out)
    # the command line: exit 2 with the message, no traceback
    proc = subprocess.run([sys.executable, "-m", "launcher.merge_lora", str(ckpt), str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "holds the adapter directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (run / "metrics.jsonl").read_text() == "{}\n" and (tmp_path / "other" / "keep").read_text() == "x"


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_merge_lora_writes_a_checkpoint_that_matches_the_adapted_model(tiny_model_dir, tmp_path, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.policy import full_state_dict

    torch.set_num_threads(1)
    cfg = _config(tiny_model_dir, f"trainer.dtype={dtype}")
    run = _learner(cfg)
    for k in range(2):
        _step(cfg, run, k)
    save_checkpoint(cfg, *run, tmp_path, 2, [])
    ckpt, out = tmp_path / "checkpoint", tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "launcher.merge_lora", str(ckpt), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (out / "tokenizer_config.json").read_bytes() == (tiny_model_dir / "tokenizer_config.json").read_bytes()
    # the trainer's own merge (what full_parameters sends to the servers) gives the same weights
    ours = full_state_dict(run[0])
    for name, p in merged.named_parameters():
        torch.testing.assert_close(p, ours[name].float(), atol=1e-6, rtol=0, msg=name)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in base.parameters():  # the base as the trainer stored it
            p.data = p.data.to(getattr(torch, dtype)).float()
    ref = PeftModel.from_pretrained(base, str(ckpt))
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        got, want = merged(ids).logits, ref(ids).logits
    assert not torch.allclose(want, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits, atol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_merge_lora_of_a_disk_sync_adapter_equals_the_bf16_engine_bit_for_bit(tiny_model_dir, tmp_path,
                                                                              one_torch_thread):
    # RUN_DIR/adapters/vN had no lora_base.json: merge_lora merged it onto the fp32 base, not the
    # bf16 one the trainer and the engine hold, and the merged model differed from what was served
    import asyncio

    from safetensors.torch import load_file

    from areal_async.inference.client import InferenceClient
    from areal_async.trainer.main import make_sender
    from tests.support.servers import running

    cfg = _config(tiny_model_dir, "trainer.dtype=bfloat16", "model.dtype=bfloat16", "trainer.weight_sync=disk",
                  "inference.num_servers=1")
    policy = _learner(cfg)[0]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))

    async def serve() -> dict[str, torch.Tensor]:
        async with running(tiny_model_dir, dtype="bfloat16") as (api, engine):
            async with InferenceClient([api.url]) as client:
                await make_sender(cfg, policy, client, tmp_path, CPU).send(1)
                assert await client.get_weight_version(0) == 1
            return {k: v.detach().clone() for k, v in engine.forward.model.named_parameters()}

    served = asyncio.run(serve())
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "launcher.merge_lora", str(tmp_path / "adapters" / "v1"), str(out),
                           "--dtype", "bfloat16"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = load_file(str(out / "model.safetensors"))
    assert set(served) <= set(merged)
    for name, want in served.items():
        got = merged[name]
        assert got.dtype == want.dtype == torch.bfloat16, name
        same = torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert same, f"{name}: {int((got != want).sum())} of {got.numel()} values differ"


def test_merge_lora_refuses_a_full_checkpoint(tiny_model_dir, tmp_path):
    from launcher.merge_lora import merge

    with pytest.raises(FileNotFoundError, match="no LoRA checkpoint"):
        merge(tiny_model_dir, tmp_path / "out")


@pytest.mark.slow
def test_a_lora_job_resumed_matches_the_unbroken_job(tiny_model_dir, tmp_path):
    # the whole job through launcher.local in deterministic mode: the weight sync sends the adapter
    # only, the checkpoint is adapter-only, and --resume starts the servers from the base with the
    # checkpoint's adapter merged (--lora-paths) and the trainer from the base + adapters
    from tests.support.jobs import fingerprint, run_job

    lora = ("trainer.lora.rank=4", "trainer.lora.alpha=16", "trainer.lr=1e-3")
    unbroken = fingerprint(run_job(tiny_model_dir, tmp_path, "unbroken", "deterministic", 1, steps=4, extra=lora))
    run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 2, steps=2, extra=lora)
    resumed_dir = run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 3, steps=4, resume=True, extra=lora)
    resumed = fingerprint(resumed_dir)
    assert "--lora-paths policy=" in (resumed_dir / "logs" / "server0.log").read_text()
    assert not (resumed_dir / "checkpoint" / "model.safetensors").exists()
    assert resumed["metrics"] == unbroken["metrics"]
    assert resumed["trajectories"] == unbroken["trajectories"]
    assert resumed["weights"] == unbroken["weights"]
    assert len({json.dumps(r.get("train/loss")) for r in unbroken["metrics"]}) > 2  # it trained


def test_a_resume_refuses_a_checkpoint_of_the_other_kind(tiny_model_dir, tmp_path):
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.lora import check_checkpoint_kind

    cfg = _config(tiny_model_dir)
    save_checkpoint(cfg, *_learner(cfg), tmp_path, 0, [])
    check_checkpoint_kind(tmp_path / "checkpoint", 4)
    with pytest.raises(ValueError, match="is a LoRA checkpoint.*launcher.merge_lora"):
        check_checkpoint_kind(tmp_path / "checkpoint", 0)
    check_checkpoint_kind(tiny_model_dir, 0)  # a full HF directory
    with pytest.raises(ValueError, match="is a full fine-tuning checkpoint"):
        check_checkpoint_kind(tiny_model_dir, 4)


def _adapter_of_a_wider_model(model_dir, out_dir):
    """A peft adapter directory for ``model_dir``'s layers but with MLP tensors of a model whose
    intermediate size is twice ``model_dir``'s (as if trained on another base)."""
    from areal_async.config import LoraConfig
    from areal_async.trainer.lora import initial_adapter, write_adapter_dir

    tensors, config = initial_adapter(str(model_dir), LoraConfig(rank=4))
    wide = {}
    for name, t in tensors.items():
        if ".mlp.down_proj.lora_A" in name or ".mlp.gate_proj.lora_B" in name or ".mlp.up_proj.lora_B" in name:
            t = torch.cat([t, t], dim=1 if "lora_A" in name else 0)
        wide[name] = t
    out_dir.mkdir()
    return write_adapter_dir(out_dir, wide, config, torch.float32)


def test_merge_lora_refuses_a_base_the_adapter_does_not_fit(tiny_model_dir, tmp_path):
    # an adapter merged onto another model used to end in peft's RuntimeError and a traceback
    # listing every tensor's size mismatch
    ckpt = _adapter_of_a_wider_model(tiny_model_dir, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-m", "launcher.merge_lora", str(ckpt), str(tmp_path / "out"),
                           "--base", str(tiny_model_dir)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "does not fit the base" in proc.stderr and "down_proj" in proc.stderr and "--base" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_merge_lora_resolves_its_base_like_model_path(tiny_model_dir, tmp_path, monkeypatch):
    # --base smollm2-135m-instruct (a model.path name) used to be looked up on the Hugging Face Hub,
    # and a missing directory ended in the Hub's "Repo id must be in the form ..."
    import launcher.merge_lora as merge_lora
    from areal_async.model import source

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from areal_async.config import LoraConfig
    from areal_async.trainer.lora import initial_adapter, write_adapter_dir

    write_adapter_dir(ckpt, *initial_adapter(str(tiny_model_dir), LoraConfig(rank=4)), torch.float32)
    with pytest.raises(ValueError, match=r"--base '.*nowhere' is neither an HF checkpoint directory.*built-in"):
        merge_lora.merge(ckpt, tmp_path / "out", base=str(tmp_path / "nowhere"))
    fetched = []
    monkeypatch.setattr(source, "_fetch_builtin", lambda name, cache: fetched.append(name) or tiny_model_dir)
    merge_lora.merge(ckpt, tmp_path / "out", base="smollm2-135m-instruct")
    assert fetched == ["smollm2-135m-instruct"] and (tmp_path / "out" / "model.safetensors").is_file()


def test_merge_lora_never_replaces_its_base(tiny_model_dir, tmp_path):
    # merge_lora ADAPTER BASE --overwrite used to replace the base with the merged model: the
    # adapter's base was gone, and a resume or a second merge applied the adapter twice
    from areal_async.config import LoraConfig
    from areal_async.trainer.lora import initial_adapter, write_adapter_dir
    from launcher.merge_lora import merge

    base = shutil.copytree(tiny_model_dir, tmp_path / "models" / "base")
    ckpt = tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    write_adapter_dir(ckpt, *initial_adapter(str(base), LoraConfig(rank=4)), torch.float32)
    weights = (base / "model.safetensors").read_bytes()
    for out, words in ((base, "is the base model"), (tmp_path / "models", "holds the base model"),
                       (base / "merged", "lies inside the base model")):
        with pytest.raises(ValueError, match=words):
            merge(ckpt, out, overwrite=True)
        with pytest.raises(ValueError, match=words):
            merge(ckpt, out, base=str(base), overwrite=True)
    assert (base / "model.safetensors").read_bytes() == weights


def test_merge_lora_names_an_unreadable_adapter_file(tiny_model_dir, tmp_path):
    # a truncated adapter_model.safetensors ended in safetensors' traceback, a broken
    # adapter_config.json in json's message without the file's name; --resume called a damaged
    # checkpoint one that "does not fit model.path"
    from areal_async.config import LoraConfig
    from areal_async.trainer.lora import check_lora_settings, initial_adapter, write_adapter_dir

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_adapter_dir(ckpt, *initial_adapter(str(tiny_model_dir), LoraConfig(rank=4)), torch.float32)
    weights, config = ckpt / "adapter_model.safetensors", ckpt / "adapter_config.json"
    good = config.read_text()
    weights.write_bytes(weights.read_bytes()[:100])
    config.write_text("{oops")
    for broken in (config, weights):
        proc = subprocess.run([sys.executable, "-m", "launcher.merge_lora", str(ckpt), str(tmp_path / "out")],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"{broken} is not readable" in proc.stderr, proc.stderr
        with pytest.raises(ValueError, match=rf"^{broken} is not readable"):  # --resume's check
            check_lora_settings(str(tiny_model_dir), LoraConfig(rank=4), ckpt)
        config.write_text(good)
