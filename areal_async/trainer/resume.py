"""Training state for a resume: step, optimizer, schedule, RNG, and the replay queue's saved buffer.

``save_training_state`` writes it into the checkpoint after the weights, ``trainer_state.json``
last; ``load_training_state`` restores it on every rank (each keeps its shard). Invariants: a
checkpoint is complete iff it holds ``trainer_state.json``; writing one never changes training
(an optimizer with no update yet stays without state), so a resume continues as the unbroken run
would. The files: docs/running.md#checkpoints-and---resume.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import msgspec
import torch
import torch.distributed as dist

from areal_async.atomic_dir import old_dir, publish, staging_dir
from areal_async.types import Trajectory


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_training_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, ckpt_dir: pathlib.Path,
                        step: int, buffer: list[Trajectory], elapsed_s: float = 0.0) -> None:
    """Collective: gather the optimizer state; rank 0 writes the files of docs/running.md#checkpoints-and---resume.

    Args:
        policy: the (FSDP2/DDP-wrapped) policy the optimizer steps.
        scheduler: the learning-rate scheduler (``schedule.make_scheduler``), already stepped past
            step ``step - 1``.
        ckpt_dir: the checkpoint directory (already holding the weights).
        step: steps done (``s``).
        buffer: ready groups to restore (``[]`` when nothing is saved, e.g. throughput mode).
        elapsed_s: the run's training wall time so far, seconds (``perf/elapsed_s``; a resumed
            run continues from it).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # ~1 CPU-s

    no_update_yet = not optimizer.state
    optim = get_optimizer_state_dict(policy, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if no_update_yet:  # the state get_optimizer_state_dict created would change the next update
        optimizer.state.clear()
        optim["state"] = {}
    if _rank() != 0:
        return
    ckpt_dir = pathlib.Path(ckpt_dir)
    torch.save({"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
               ckpt_dir / "trainer_state.pt")
    (ckpt_dir / "buffer.msgpack").write_bytes(msgspec.msgpack.encode(buffer))
    (ckpt_dir / "trainer_state.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed_s}))


def publish_checkpoint(ckpt_dir: pathlib.Path) -> None:
    """Make the complete checkpoint in ``staging_dir(ckpt_dir)`` the one in ``ckpt_dir``.

    A checkpoint is written whole into the staging directory first (weights, then the training
    state, ``trainer_state.json`` last), so an interrupted write leaves the previous checkpoint
    untouched. The swap is ``atomic_dir.publish``: two renames (the old one to ``<ckpt_dir>.old``,
    the new one into place), then the old one is removed; ``recover_checkpoint`` repairs an
    interruption between them.
    """
    staging = staging_dir(ckpt_dir)
    if not (staging / "trainer_state.json").exists():
        raise FileNotFoundError(f"{staging} holds no complete checkpoint to publish")
    publish(ckpt_dir)


def recover_checkpoint(ckpt_dir: pathlib.Path) -> None:
    """After an interrupted ``publish_checkpoint`` (no complete ``ckpt_dir`` but a complete
    ``<ckpt_dir>.old``), put the old one back; a half-written staging directory is removed. A
    no-op when ``ckpt_dir`` is complete."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    old = old_dir(ckpt_dir)
    if not (ckpt_dir / "trainer_state.json").exists() and (old / "trainer_state.json").exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        old.rename(ckpt_dir)
    staging = staging_dir(ckpt_dir)
    if staging.exists() and not (staging / "trainer_state.json").exists():
        shutil.rmtree(staging, ignore_errors=True)


def read_step(ckpt_dir: pathlib.Path) -> int:
    """Steps done by the checkpoint in ``ckpt_dir``.

    Raises:
        FileNotFoundError: no complete training state there (nothing to resume from).
    """
    path = pathlib.Path(ckpt_dir) / "trainer_state.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no checkpoint with training state to resume "
                                f"from (a run writes one every trainer.checkpoint_every steps and at its end); "
                                f"start the run afresh with --overwrite instead of --resume, and set "
                                f"trainer.checkpoint_every=N to be able to resume it")
    return int(json.loads(path.read_text())["step"])


def check_restored_groups(ckpt_dir: pathlib.Path, batch_size: int, n_samples: int) -> None:
    """Raise ``ValueError`` naming the key if the groups the checkpoint in ``ckpt_dir`` saved
    (``buffer.msgpack``) do not fit this launch: a queue resumed at its step restores ids from step ×
    ``queue.batch_size`` on (``ReplayQueue``), and the trainer takes groups of ``rollout.n_samples``
    samples. Raises as ``read_step``; a checkpoint without saved groups passes."""
    step, path = read_step(ckpt_dir), pathlib.Path(ckpt_dir) / "buffer.msgpack"
    groups = msgspec.msgpack.decode(path.read_bytes(), type=list[Trajectory]) if path.exists() else []
    if not groups:
        return
    ids = sorted(t.group_id for t in groups)
    if ids != list(range(step * batch_size, step * batch_size + len(ids))):
        used = f"queue.batch_size={ids[0] // step}" if step and ids[0] % step == 0 else "another queue.batch_size"
        raise ValueError(f"--resume: the checkpoint at step {step} saved groups {ids[0]}-{ids[-1]}, made with {used}, "
                         f"but this launch has queue.batch_size={batch_size} (its groups start at step × batch "
                         f"size); resume with the run's {used}")
    if sizes := sorted({len(t.samples) for t in groups} - {n_samples}):
        raise ValueError(f"--resume: the checkpoint at step {step} saved groups of {sizes[0]} samples "
                         f"(rollout.n_samples={sizes[0]}), but this launch has rollout.n_samples={n_samples}; "
                         f"resume with the run's rollout.n_samples={sizes[0]}")


def read_elapsed(ckpt_dir: pathlib.Path) -> float:
    """The training wall time (seconds) recorded with the checkpoint in ``ckpt_dir``; 0.0 for a
    checkpoint written before it was recorded. Raises as ``read_step``."""
    read_step(ckpt_dir)
    return float(json.loads((pathlib.Path(ckpt_dir) / "trainer_state.json").read_text()).get("elapsed_s", 0.0))


def load_training_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, ckpt_dir: pathlib.Path) -> int:
    """Collective: restore the optimizer state (each rank its shard), the learning-rate scheduler
    and the RNG; returns the step.

    The weights are loaded separately (``build_policy`` from ``ckpt_dir``). An optimizer saved
    before its first update is restored with no state (docs/trainer.md#precision). The learning rate
    follows ``scheduler`` as built from this run's config, at the checkpoint's step (``last_epoch =
    step``): unchanged, that is the rate an unbroken run has (the same expression, bit for bit);
    a resume that changes the schedule (``trainer.total_steps`` to train further, ``trainer.lr``)
    gets the new one from its first step, where the saved optimizer's rate would hold the old one
    for a step.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    base_lrs = list(scheduler.base_lrs)  # this run's (trainer.lr): the saved state holds the old run's
    state = torch.load(pathlib.Path(ckpt_dir) / "trainer_state.pt", weights_only=False)
    set_optimizer_state_dict(policy, optimizer, optim_state_dict=state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    if not state["optimizer"]["state"]:  # saved before any update: drop the state the load created
        optimizer.state.clear()
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    step = int(state["step"])
    scheduler.base_lrs, scheduler.last_epoch = base_lrs, step
    scheduler._last_lr = [base * fn(step) for base, fn in zip(base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(optimizer.param_groups, base_lrs, scheduler._last_lr):
        group["initial_lr"], group["lr"] = base, lr
    torch.set_rng_state(state["rng"])
    return step


def drop_superseded_rows(path: pathlib.Path, step: int) -> int:
    """Remove from the JSON-lines log ``path`` (``metrics.jsonl``, ``trajectories.jsonl``) every
    row that a run resumed at ``step`` writes again: rows of ``"step" >= step``, except an
    evaluation row (only ``eval/*`` keys) at ``step`` itself, which measured the checkpoint's
    weights and is not repeated. A job stopped after its checkpoint at ``step`` has logged steps
    past it; without this they would appear twice, and step curves would run backwards.

    The file is rewritten through a temporary file and ``os.replace``, so a crash keeps one whole
    version. Returns the number of rows removed; a missing file is left missing.
    """
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _kept(json.loads(line), step)]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _kept(row: dict, step: int) -> bool:
    if row["step"] < step:
        return True
    keys = [k for k in row if k not in ("step", "time")]
    return row["step"] == step and bool(keys) and all(k.startswith("eval/") for k in keys)


def has_eval_row(path: pathlib.Path, step: int) -> bool:
    """Whether the metrics log ``path`` holds an evaluation row (``eval/pass@1``) at ``step``. A job
    stopped after its checkpoint at ``step`` but before that step's evaluation finished has none,
    and the resumed run evaluates the checkpoint's weights first. A missing file holds none."""
    if not path.exists():
        return False
    return any((row := json.loads(line))["step"] == step and "eval/pass@1" in row
               for line in path.read_text().splitlines())
