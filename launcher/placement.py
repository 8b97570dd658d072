"""Where ``launcher.local`` runs each process of a job: its CPUs, its threads, its GPUs.

``place_job`` turns the config's placement keys into one ``Place`` per process, a pure function of
the config, the CPUs this launcher may use and its environment:

- ``inference.cpus``: divided equally among the servers in order (``"0-3"``, 2 servers: ``0-1``
  and ``2-3``); each server's torch threads are its part's size unless ``inference.threads`` is set.
- ``trainer.cpus``: torchrun is pinned to the whole list, and each rank pins itself to its equal
  part (``areal_async.cpus.pin_rank``); ``OMP_NUM_THREADS`` is a part's size unless the launcher's
  environment sets it.
- ``queue.cpus``, ``rollout.cpus``: the queue's and every worker's list (not divided), threads as
  the trainer's.
- ``trainer.gpus``: the ranks' CUDA devices in the launcher's numbering, given to torchrun as
  ``CUDA_VISIBLE_DEVICES`` (mapped through the launcher's own), so that rank r, on its ``cuda:r``,
  runs on the r-th of them.

``cpu_threads: adaptive`` adds each server's and trainer rank's slot of the ledger
(``areal_async/cpu_share.py``) to its environment; ``check_adaptive`` says where it does not apply
(a warning, threads fixed) or contradicts a key (refused). ``launcher.ray`` keeps threads fixed.
An empty key leaves that process as before: not pinned, threads divided from the CPU count
(``cpu_count // (num_servers + nproc)``). The supervisor applies ``Place.cpus`` with
``sched_setaffinity`` between fork and exec, so the process and every thread it starts inherit it.
Lists may overlap; servers and trainer sharing CPUs is a warning (``JobPlacement.warnings``), since
pinning them apart is the point. ``launcher.ray`` refuses these keys (``refuse_on_ray``): Ray places
its actors itself. Keys and examples: docs/running.md#placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from areal_async.config import Config
from areal_async.cpu_share import PATH_ENV, SLOT_ENV
from areal_async.cpus import RANK_CPUS_ENV, divide, format_list, parse_list

PINNING_KEYS = ("inference.cpus", "trainer.cpus", "trainer.gpus", "queue.cpus", "rollout.cpus")
LEDGER_NAME = "cpu_share"  # cpu_threads: adaptive: RUN_DIR/cpu_share, one byte per server and trainer rank


@dataclasses.dataclass(frozen=True)
class Place:
    """One process's placement: ``cpus`` it is pinned to (``()``: wherever the OS puts it),
    ``threads`` (a server's ``--threads``; 0 for the others) and ``env``, added to the job's."""

    cpus: tuple[int, ...] = ()
    threads: int = 0
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return f"CPUs {format_list(self.cpus)}" if self.cpus else "any CPU"


@dataclasses.dataclass(frozen=True)
class JobPlacement:
    """Every process's ``Place`` (``servers[i]``: server i) and the warnings about the lists."""

    servers: list[Place]
    queue: Place
    workers: Place
    trainer: Place
    warnings: list[str]

    @property
    def pins(self) -> bool:
        """Whether any process is pinned to CPUs or the trainer to GPUs (a placement key is set)."""
        places = (*self.servers, self.queue, self.workers, self.trainer)
        return any(p.cpus for p in places) or "CUDA_VISIBLE_DEVICES" in self.trainer.env

    def describe(self) -> str:
        """One line for the launcher's output, e.g. ``server0 on CPUs 0 (1 thread), ...``."""
        parts = [f"server{i} on {p.describe()} ({p.threads} thread(s))" for i, p in enumerate(self.servers)]
        cuda = self.trainer.env.get("CUDA_VISIBLE_DEVICES")
        parts += [f"trainer on {self.trainer.describe()} (OMP_NUM_THREADS={self.trainer.env['OMP_NUM_THREADS']}"
                  + (f", CUDA_VISIBLE_DEVICES={cuda})" if cuda is not None else ")"),
                  f"queue on {self.queue.describe()}", f"workers on {self.workers.describe()}"]
        return ", ".join(parts)


def _cpus(key: str, text: str, allowed: frozenset[int]) -> tuple[int, ...]:
    """The CPUs ``key`` names, each checked against ``allowed`` (this launcher's affinity)."""
    cpus = parse_list(key, text)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"{key}={text!r}: CPU {outside[0]} is not one this launcher may run on (allowed: "
                         f"{format_list(allowed)}, os.sched_getaffinity); choose CPUs among those")
    return cpus


def _threads_env(cpus: tuple[int, ...], environ: Mapping[str, str]) -> dict[str, str]:
    return {"OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS") or str(len(cpus))} if cpus else {}


def cuda_visible_devices(gpus: tuple[int, ...], parent: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process that should see the launcher's ``cuda:g`` for each
    ``g`` in ``gpus``, in that order, given the launcher's own value ``parent`` (``None``: unset,
    every GPU in CUDA's order).

    Raises:
        ValueError: ``parent`` shows fewer GPUs than an index needs; names both.
    """
    if parent is None:
        return ",".join(str(g) for g in gpus)
    shown = [entry.strip() for entry in parent.split(",") if entry.strip()]
    for g in gpus:
        if g >= len(shown):
            raise ValueError(f"trainer.gpus names cuda:{g}, but CUDA_VISIBLE_DEVICES={parent!r} shows this launcher "
                             f"{len(shown)} GPU(s), cuda:0 to cuda:{len(shown) - 1}; choose among those")
    return ",".join(shown[g] for g in gpus)


def trainer_gpus(cfg: Config) -> tuple[int, ...]:
    """The CUDA devices (the launcher's numbering) of trainer ranks 0..nproc-1.

    Raises:
        ValueError: ``trainer.gpus`` is no list, or does not name one GPU per rank.
    """
    nproc, text = cfg.trainer.nproc, cfg.trainer.gpus
    if not text:
        return tuple(range(nproc))
    gpus = parse_list("trainer.gpus", text)
    if len(gpus) != nproc:
        raise ValueError(f"trainer.gpus={text!r} names {len(gpus)} GPU(s) for trainer.nproc={nproc} rank(s); "
                         f"name one GPU per rank, e.g. trainer.gpus=\"{format_list(range(1, 1 + nproc))}\"")
    return gpus


def place_job(cfg: Config, allowed: frozenset[int], cpu_count: int, environ: Mapping[str, str]) -> JobPlacement:
    """Each process's ``Place`` (module docstring). ``allowed``: the CPUs this launcher may use
    (``os.sched_getaffinity(0)``); ``cpu_count``: ``os.cpu_count()``, which divides threads among
    unpinned processes as before; ``environ``: the launcher's environment.

    Raises:
        ValueError: a list that is malformed, names a CPU outside ``allowed``, or does not divide
            equally among its processes; ``trainer.gpus`` as ``trainer_gpus``, ``cuda_visible_devices``.
    """
    inf, tr = cfg.inference, cfg.trainer
    shared = max(1, cpu_count // (inf.num_servers + tr.nproc))  # the threads of an unpinned server or rank
    server_cpus = _cpus("inference.cpus", inf.cpus, allowed)
    if server_cpus:
        parts = divide("inference.cpus", server_cpus, inf.num_servers, "servers (inference.num_servers)")
        servers = [Place(part, inf.threads or len(part)) for part in parts]
    else:
        servers = [Place((), inf.threads or shared)] * inf.num_servers
    rank_cpus = _cpus("trainer.cpus", tr.cpus, allowed)
    env = {"OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS") or str(shared)}
    if rank_cpus:
        ranks = divide("trainer.cpus", rank_cpus, tr.nproc, "trainer ranks (trainer.nproc)")
        env = {**_threads_env(ranks[0], environ), RANK_CPUS_ENV: ";".join(format_list(r) for r in ranks)}
    if tr.gpus:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(trainer_gpus(cfg), environ.get("CUDA_VISIBLE_DEVICES"))
    trainer = Place(rank_cpus, 0, env)
    queue_cpus = _cpus("queue.cpus", cfg.queue.cpus, allowed)
    worker_cpus = _cpus("rollout.cpus", cfg.rollout.cpus, allowed)
    warnings = []
    both = set(server_cpus) & set(rank_cpus)
    if both:
        warnings.append(f"inference.cpus={inf.cpus!r} and trainer.cpus={tr.cpus!r} share CPU(s) {format_list(both)}: "
                        f"the servers and the trainer compete there; give them disjoint lists to keep them apart")
    adaptive = cfg.cpu_threads == "adaptive"
    why_fixed = check_adaptive(cfg) if adaptive else ""
    if why_fixed:
        warnings.append(why_fixed)
    if adaptive and not why_fixed:
        ledger = str((cfg.run_dir / LEDGER_NAME).resolve())
        # OpenMP threads that sleep at a barrier rather than spin: a count that lags the ledger for one
        # step or layer then costs little; spinning cost 1.45x in step time at eta = 1 (docs/performance.md)
        wait = {"OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY") or "PASSIVE"}
        servers = [dataclasses.replace(p, env={**p.env, **wait, PATH_ENV: ledger, SLOT_ENV: str(i)})
                   for i, p in enumerate(servers)]
        trainer = dataclasses.replace(trainer, env={**trainer.env, **wait, PATH_ENV: ledger,
                                                    SLOT_ENV: str(inf.num_servers)})
    return JobPlacement(servers, Place(queue_cpus, 0, _threads_env(queue_cpus, environ)),
                        Place(worker_cpus, 0, _threads_env(worker_cpus, environ)), trainer, warnings)


def check_adaptive(cfg: Config) -> str:
    """Why ``cpu_threads: adaptive`` does not apply to ``cfg``'s job (``""``: it does): a CUDA
    device, the SGLang backend or ``mode: deterministic`` (a thread count changes the order of float
    sums) keep the threads fixed, with this as the launcher's warning.

    Raises:
        ValueError: settings that contradict it: pinned processes (each keeps to its own CPUs, there
            is nothing to lend) or fixed server threads.
    """
    pinned = [f"{key}={getattr(getattr(cfg, key.partition('.')[0]), key.partition('.')[2])!r}" for key in PINNING_KEYS
              if getattr(getattr(cfg, key.partition(".")[0]), key.partition(".")[2])]
    if pinned:
        raise ValueError(f"cpu_threads=adaptive: {', '.join(pinned)} pin processes apart, so none can lend its "
                         f"cores; leave the placement keys empty, or set cpu_threads=fixed")
    if cfg.inference.threads > 0:
        raise ValueError(f"cpu_threads=adaptive: inference.threads={cfg.inference.threads} fixes the servers' "
                         f"threads; set it to 0, or cpu_threads=fixed")
    fallbacks = [
        (any(d.startswith("cuda") for d in (cfg.inference.device, cfg.trainer.device)),
         f"inference.device={cfg.inference.device!r}, trainer.device={cfg.trainer.device!r}: the work is on a GPU"),
        (cfg.inference.backend != "embedded", f"inference.backend={cfg.inference.backend!r}: only the embedded "
                                              f"engine follows the ledger"),
        (cfg.mode == "deterministic", "mode=deterministic needs fixed thread counts (a count changes the order of "
                                      "float sums)"),
    ]
    why = [reason for applies, reason in fallbacks if applies]
    return f"cpu_threads=adaptive does not apply ({'; '.join(why)}): the threads stay fixed" if why else ""


def refuse_on_ray(cfg: Config) -> None:
    """Raise ``ValueError`` naming the placement keys set: under ``launcher.ray`` each process runs
    in its Ray bundle, which this launcher does not pin; ``cluster.*`` sizes the bundles."""
    values = {key: getattr(getattr(cfg, key.partition(".")[0]), key.partition(".")[2]) for key in PINNING_KEYS}
    given = [f"{key}={value!r}" for key, value in values.items() if value]
    if given:
        raise ValueError(f"{', '.join(given)}: launcher.ray does not pin processes (Ray places each in its bundle: "
                         f"cluster.cpus_per_server, cluster.gpus_per_trainer_rank, ...); leave "
                         f"{'it' if len(given) == 1 else 'them'} empty, or run with launcher.local")
