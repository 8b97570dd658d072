"""The trainer process: ``torchrun --nproc-per-node N -m areal_async.trainer.main --config RUN_DIR/config.yaml``.

Per step k: take batch k, one decoupled-PPO step, publish version k+1, log, checkpoint; any
exception ends the process with its traceback, non-zero (docs/trainer.md#the-loop).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import pathlib
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from areal_async.config import Config, load_config
from areal_async.cpus import pin_rank
from areal_async.dtypes import FLOAT_DTYPES, dtype_from_name
from areal_async.trainer.coordinator import connect
from areal_async.trainer.learner import Learner
from areal_async.trainer.lora import adapter_config, adapter_parameters, lora_enabled
from areal_async.trainer.lora_sync import DiskAdapterSender, DistributedAdapterSender
from areal_async.trainer.report import Timer
from areal_async.trainer.weight_sync import DiskWeightSender, DistributedWeightSender, WeightSender


def make_sender(cfg: Config, policy, client, run_dir: pathlib.Path, device: torch.device) -> WeightSender:
    """The ``trainer.weight_sync`` implementation, sending in the servers' dtype (``model.dtype``),
    interrupting the generations in flight or waiting for them (``rollout.interrupt_on_update``)."""
    n, dtype = cfg.inference.num_servers, dtype_from_name(cfg.model.dtype, FLOAT_DTYPES, "model.dtype")
    interrupt = cfg.rollout.interrupt_on_update
    if lora_enabled(policy):  # the adapter only (docs/lora_sync.md), merged by each server into its base
        items, config = functools.partial(adapter_parameters, policy), functools.partial(adapter_config, policy)
        if cfg.trainer.weight_sync == "disk":
            return DiskAdapterSender(items, config, client, n, run_dir / "adapters", dtype, interrupt,
                                     backend=cfg.inference.backend, base_dtype=dtype)
        return DistributedAdapterSender(items, config, client, n, cfg.trainer.weight_sync_host,
                                        cfg.trainer.weight_sync_port, cfg.trainer.weight_bucket_bytes, device, dtype,
                                        interrupt)
    if cfg.trainer.weight_sync == "disk":
        return DiskWeightSender(policy, client, n, cfg.model.path, run_dir / "weights", dtype, interrupt)
    return DistributedWeightSender(policy, client, n, cfg.trainer.weight_sync_host, cfg.trainer.weight_sync_port,
                                   cfg.trainer.weight_bucket_bytes, dtype, device, interrupt)


async def train(cfg: Config, run_dir: pathlib.Path) -> None:
    """Run steps ``learner.start .. trainer.total_steps - 1`` on this rank (docs/trainer.md#the-loop)."""
    learner = Learner(cfg, run_dir)  # joins the default group; the policy built or restored
    async with contextlib.AsyncExitStack() as stack:
        coord = await connect(cfg, run_dir, learner, stack, make_sender)  # rank 0's duties, or their twin
        for k in range(learner.start, cfg.trainer.total_steps):
            timer = Timer()
            with timer("step_s"):
                trajs = await coord.take(k, timer)
                with timer("train_s"), coord.training(k) as on_micro_batch:
                    metrics = learner.step(trajs, on_micro_batch)
                await coord.publish(k + 1, timer)
            await coord.log(k, trajs, metrics, timer)
            await coord.settle(k)
        await coord.finish()
    dist.barrier()
    dist.destroy_process_group()


TORCHRUN_PID_ENV = "AREAL_ASYNC_TORCHRUN_PID"  # set by launcher.torchrun: the ranks' parent


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when its parent (torchrun) dies, even when the parent is killed
    with SIGKILL and cannot stop its ranks (the launcher gives torchrun the same setting). Exit at
    once if the parent, ``TORCHRUN_PID_ENV`` where set, is already gone."""
    parent = int(os.environ.get(TORCHRUN_PID_ENV) or os.getppid())
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent was already gone
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    import uvloop

    _die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m areal_async.trainer.main", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved RUN_DIR/config.yaml")
    args = parser.parse_args(argv)
    pin_rank()  # trainer.cpus: this rank's part (launcher/placement.py); the threads torch starts later inherit it
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    code = 0
    try:
        uvloop.run(train(load_config(args.config), pathlib.Path(args.config).resolve().parent))
    except BaseException as exc:
        traceback.print_exc()
        code = (exc.code or 0) if isinstance(exc, SystemExit) and isinstance(exc.code, (int, type(None))) else 1
    # Leave without interpreter finalization, after success and failure alike: C++ threads of the
    # (destroyed) gloo groups can still be joinable then, and their destructors call std::terminate
    # ("terminate called without an active exception", SIGABRT), which turned a finished run into a
    # failed one; and after a failure a thread can still be blocked in a collective whose peer is
    # gone (a weight broadcast a server refused), which interpreter exit would join.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
