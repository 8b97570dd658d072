"""What the launcher settles about a config on the machine it launches from, before any process starts.

- ``check_devices``: the device rules of the NCCL weight sync (one GPU per process; trainer rank r
  on ``cuda:r``), and (unless each process has its own GPUs under Ray) that every device string
  names a device torch sees here.
- ``resolve_dtypes``: ``model.dtype`` / ``trainer.dtype`` ``auto`` → bf16 on CUDA and on CPUs
  with native bf16, float32 on other CPUs.
- ``resolve_tree_attention``: ``trainer.tree_attention`` ``auto`` → the path it takes here
  (``areal_async/trainer/tree_paths.py``; call after ``resolve_dtypes``).

``launcher.local.prepare_run`` calls them in that order (``launcher.ray`` through it) and writes the
result to ``RUN_DIR/config.yaml``, so the job's processes see the resolved values (the trainer,
the queue and the workers load that file; the servers get theirs on their command lines). Each
takes ``cuda_available`` from its caller and asks nothing else of torch. The machine facts they use
(``cuda_index``, ``cpu_has_bf16``) are in ``areal_async/devices.py``; the rules on the config's own
values, whatever the machine, are ``config.check_config``.
"""

from __future__ import annotations

import msgspec

from areal_async.config import Config
from areal_async.cpus import format_list
from areal_async.devices import cpu_has_bf16, cuda_index
from launcher.placement import trainer_gpus
from areal_async.trainer.tree_paths import tree_attention_choice


def check_devices(cfg: Config, cuda_available: bool, own_gpus: bool = False) -> None:
    """NCCL weight sync needs every process of its group on its own GPU: trainer rank r runs on
    ``cuda:r``, or on the r-th of ``trainer.gpus`` (``launcher/placement.py``), and each server on
    ``inference.device``. Raises ``ValueError`` naming the keys and the fix when two would share
    one (NCCL refuses: "Duplicate GPU detected"), or when ``trainer.gpus`` is set for a trainer on
    the CPU or does not name one GPU per rank.

    ``own_gpus``: ``launcher.ray`` with GPUs in every server's and trainer rank's bundle
    (``cluster.gpus_per_server``, ``cluster.gpus_per_trainer_rank``): each process sees only its own
    GPUs, as ``cuda:0``, on a node that may not be this one, so no two share one and this
    machine's CUDA is not asked; ``inference.device`` must then be ``cuda``/``cuda:0``/``auto``."""
    if cfg.trainer.device.startswith("cuda:"):
        raise ValueError(f"trainer.device={cfg.trainer.device!r}: rank r always runs on cuda:r; use "
                         f"trainer.device=cuda (and trainer.gpus to choose the GPUs, e.g. trainer.gpus=\"1\")")
    if own_gpus:
        if cfg.inference.device not in ("auto", "cuda", "cuda:0"):
            raise ValueError(f"inference.device={cfg.inference.device!r}, but each server's Ray bundle holds its "
                             f"own GPUs (cluster.gpus_per_server={cfg.cluster.gpus_per_server:g}), which it "
                             f"sees from cuda:0; use inference.device=cuda")
        return
    server = cuda_index("inference.device", cfg.inference.device, cuda_available)
    trainer = cuda_index("trainer.device", cfg.trainer.device, cuda_available)
    if cfg.trainer.gpus and trainer is None:
        raise ValueError(f"trainer.gpus={cfg.trainer.gpus!r} but the trainer runs on the CPU (trainer.device="
                         f"{cfg.trainer.device!r}); set trainer.device=cuda, or trainer.gpus=\"\"")
    ranks = trainer_gpus(cfg)  # a ValueError unless one GPU per rank
    if cfg.trainer.weight_sync != "distributed" or cfg.inference.backend != "embedded":
        return
    if (server is None) != (trainer is None):
        raise ValueError(
            f"NCCL/gloo weight sync needs the trainer and the servers on the same kind of device, got "
            f"trainer.device={cfg.trainer.device!r} and inference.device={cfg.inference.device!r}; "
            f"put both on CUDA (or both on CPU), or set trainer.weight_sync=disk")
    if server is None:
        return
    if cfg.inference.num_servers > 1:
        raise ValueError(
            f"inference.num_servers={cfg.inference.num_servers} servers would all run on "
            f"inference.device={cfg.inference.device!r} (cuda:{server}), and NCCL weight sync needs one GPU "
            f"per process; set trainer.weight_sync=disk, or run one server per GPU")
    if server in ranks:
        free = next(g for g in range(max(ranks) + 2) if g not in ranks)
        raise ValueError(
            f"inference.device={cfg.inference.device!r} (cuda:{server}) is also trainer rank {ranks.index(server)}'s "
            f"GPU (trainer.nproc={cfg.trainer.nproc} ranks use cuda:{format_list(ranks)}, trainer.gpus="
            f"{cfg.trainer.gpus!r}), and NCCL weight sync needs one GPU per process; set inference.device=cuda:{free} "
            f"or move the trainer (e.g. trainer.gpus=\"{format_list(g + 1 for g in ranks)}\" with the server on "
            f"cuda:0) on a machine with more GPUs, or trainer.weight_sync=disk")


def resolve_dtypes(cfg: Config, cuda_available: bool) -> Config:
    """Replace ``auto`` in ``model.dtype`` (the servers') and ``trainer.dtype`` (compute): bf16
    on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    def pick(key: str, device: str) -> str:
        on_cuda = cuda_index(key, device, cuda_available) is not None
        return "bfloat16" if on_cuda or cpu_has_bf16() else "float32"

    model, trainer = cfg.model, cfg.trainer
    if model.dtype == "auto":
        model = msgspec.structs.replace(model, dtype=pick("inference.device", cfg.inference.device))
    if trainer.dtype == "auto":
        trainer = msgspec.structs.replace(trainer, dtype=pick("trainer.device", trainer.device))
    return msgspec.structs.replace(cfg, model=model, trainer=trainer)


def resolve_tree_attention(cfg: Config, cuda_available: bool) -> Config:
    """Replace ``auto`` in ``trainer.tree_attention`` by the path it takes on this machine
    (``tree_attention_choice``; call after ``resolve_dtypes``).

    Raises:
        ValueError: see ``tree_attention_choice``.
    """
    cuda = cuda_index("trainer.device", cfg.trainer.device, cuda_available) is not None
    path = tree_attention_choice(cfg.trainer.tree_attention, cuda, cfg.trainer.dtype, cfg.mode == "deterministic")
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, tree_attention=path))
