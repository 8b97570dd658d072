"""``Learner``: one trainer rank's policy, AdamW and learning-rate schedule, fresh or restored.

``step`` and ``save_checkpoint`` are collectives. Deterministic mode is set up here once, before
CUDA and NCCL start (environment, deterministic algorithms, tiled linears; docs/determinism.md#how).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable

import torch

from areal_async.atomic_dir import new_staging_dir, staging_dir
from areal_async.config import Config
from areal_async.cpu_share import from_environment, refresh_around_layers
from areal_async.determinism import deterministic_env
from areal_async.trainer.checkpoint import save_hf_checkpoint
from areal_async.trainer.lora import (adapter_config, adapter_state_dict, base_dtype, check_checkpoint_kind,
                                      check_lora_settings, lora_enabled, write_adapter_dir)
from areal_async.trainer.policy import (build_policy, full_state_dict, hf_model, init_distributed,
                                        trainable_parameters)
from areal_async.trainer.resume import (load_training_state, publish_checkpoint, read_elapsed,
                                        save_training_state)
from areal_async.trainer.schedule import make_scheduler
from areal_async.trainer.step import train_step
from areal_async.types import Trajectory


class Learner:
    """This rank's policy, optimizer and scheduler, at step ``start`` (0, or the checkpoint's).

    Attributes:
        device: this rank's device. policy, optimizer, scheduler: as built (or restored).
        start: steps already done (the policy's version at construction).
        version: the policy's version now (``start`` + the steps this object ran).
        elapsed_before_s: training wall time of the run before this job, seconds (the
            checkpoint's; 0.0 for a fresh run): ``perf/elapsed_s`` continues from it.
    """

    def __init__(self, cfg: Config, run_dir: pathlib.Path):
        t = cfg.trainer
        deterministic = cfg.mode == "deterministic"
        os.environ.update(deterministic_env(cfg.mode))  # before CUDA / NCCL initialise
        self.device = init_distributed(t.device)
        torch.manual_seed(cfg.seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
        self.cfg, self.run_dir = cfg, run_dir
        ckpt_dir = run_dir / "checkpoint"
        if t.resume:
            check_checkpoint_kind(ckpt_dir, t.lora.rank)
            if t.lora.rank:
                check_lora_settings(cfg.model.path, t.lora, ckpt_dir, t.dtype)
        if t.lora.rank:  # a LoRA checkpoint holds the adapters only: the base is the model's
            self.policy = build_policy(cfg.model.path, t, self.device, batch_invariant=deterministic,
                                       adapter_dir=str(ckpt_dir) if t.resume else None)
        else:
            self.policy = build_policy(str(ckpt_dir) if t.resume else cfg.model.path, t, self.device,
                                       batch_invariant=deterministic)
        # with LoRA the adapters only (AdamW state for them alone); all parameters otherwise
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.policy), lr=t.lr, betas=t.adam_betas,
                                           weight_decay=t.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, t)  # stepped once per training step
        self.start = load_training_state(self.policy, self.optimizer, self.scheduler, ckpt_dir) if t.resume else 0
        self.version = self.start  # the policy version held: steps done
        # perf/elapsed_s: training wall time from the first step on, summed over resumes (a stopped
        # job's time after its checkpoint, and the pause before the resume, are not counted)
        self.elapsed_before_s = read_elapsed(ckpt_dir) if t.resume else 0.0
        # cpu_threads: adaptive: threads follow who computes, refreshed before each decoder layer's
        # forward and backward (areal_async/cpu_share.py)
        self.cpu_share = from_environment(local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        if self.cpu_share is not None:
            refresh_around_layers(self.cpu_share, hf_model(self.policy).model.layers)

    def step(self, trajs: list[Trajectory], on_micro_batch: Callable[[int, int], None] | None = None) -> dict:
        """Collective: one training step on batch ``trajs`` (the same on every rank), then one
        scheduler step; returns ``train_step``'s metrics (``train/*``)."""
        cfg = self.cfg
        with self.cpu_share.working() if self.cpu_share is not None else contextlib.nullcontext():
            metrics = train_step(self.policy, self.optimizer, trajs, cfg.algo, cfg.trainer, cfg.rollout.temperature,
                                 self.device, on_micro_batch=on_micro_batch, version=self.version)
        self.scheduler.step()
        self.version += 1
        return metrics

    def save_checkpoint(self, step: int, buffer: list[Trajectory], elapsed_s: float) -> None:
        """Collective: ``save_checkpoint`` of this rank's state into ``RUN_DIR/checkpoint``."""
        save_checkpoint(self.cfg, self.policy, self.optimizer, self.scheduler, self.run_dir, step, buffer, elapsed_s)


def save_checkpoint(cfg: Config, policy, optimizer, scheduler, run_dir: pathlib.Path, step: int,
                    buffer: list[Trajectory], elapsed_s: float = 0.0) -> None:
    """Collective: rank 0 writes ``RUN_DIR/checkpoint``: the fp32 master weights (HF directory),
    then the training state of ``step`` and the queue's saved ``buffer`` (``resume.py``), all into
    a staging directory that replaces the previous checkpoint only once complete. With LoRA the
    weights are the adapters only, a peft adapter directory (``lora.write_adapter_dir``;
    ``launcher.merge_lora`` turns it into a full HF directory)."""
    ckpt = run_dir / "checkpoint"
    if lora_enabled(policy):
        state = adapter_state_dict(policy)
        if state is not None:
            write_adapter_dir(new_staging_dir(ckpt), state, adapter_config(policy), base_dtype(policy))
    else:
        state = full_state_dict(policy)
        if state is not None:
            save_hf_checkpoint(state, cfg.model.path, new_staging_dir(ckpt), torch.float32)
    save_training_state(policy, optimizer, scheduler, staging_dir(ckpt), step, buffer, elapsed_s)
    if state is not None:
        publish_checkpoint(ckpt)
