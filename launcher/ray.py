"""Run a training job on a Ray cluster: every process of ``launcher.local``'s job in a Ray actor.

    python -m launcher.ray configs/quickstart_cpu.yaml [section.key=value ...] [--address auto|ray://...]
                           [--overwrite | --resume]

The job is ``launcher.local``'s step for step (``prepare_run``, ``launch``, ``run_job``); only where
each process runs differs: ``RaySupervisor`` stands in for ``launcher.supervisor.Supervisor`` and
runs each process in a ``launcher.ray_actor.ProcessActor`` (``RayChild``) in its own bundle of one
placement group (``launcher/ray_placement.py``); each trainer rank is an actor with torchrun's
environment, the ranks supervised as one child (``RankGroup``). Every exit stops each process and
kills each actor. Simplifications (a shared filesystem; ports chosen on the launcher's node; the
servers on one node address), the listeners across hosts and what was tested: docs/ray.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import re
import signal
import sys
import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import remove_placement_group

from areal_async.config import Config, dump_config, load_config
from launcher import local
from launcher.placement import refuse_on_ray
from launcher.ray_placement import Placement, bind_hosts, bundles_of, reserve
from launcher.supervisor import HealthCheck, JobFailed, Restart, Supervised, Supervisor

__all__ = ["Placement", "RankGroup", "RayChild", "RaySupervisor", "bind_hosts", "bundles_of", "main", "reserve"]

_ROLE_OF = re.compile(r"(server|worker)\d+|queue|trainer")
_STOP_RPC_S = 30.0  # beyond the child's grace: the actor is then killed anyway
_TAIL_LINES = 40
class RayChild:
    """Driver-side stand-in for a ``launcher.supervisor.Child`` whose process runs in a
    ``ProcessActor``: the attributes and methods ``Supervisor`` uses (``poll``, ``tail``,
    ``respawn``, ``stop``, the restart bookkeeping), each a call to the actor.

    ``make_actor()`` makes its actor (again, if one dies and the process is restarted);
    ``before_start(actor)`` runs before the process starts (the rank-0 rendezvous store);
    ``local_log``: the actor runs on the launcher's node and writes ``log_dir/<name>.log`` itself.
    ``health``: checked by the supervisor from the launcher's node (the probe asks the server's
    URL), which kills the process through its actor (``kill``) when a check fails.
    """

    def __init__(self, name: str, argv: list[str], make_actor: Callable, log_dir: pathlib.Path,
                 env: dict[str, str], local_log: bool, echo: bool = False, expect_exit: bool = False,
                 log_header: str | None = None, restart: Restart | None = None,
                 health: HealthCheck | None = None, before_start: Callable | None = None):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self.expect_exit, self.restart, self.echo = expect_exit, restart, echo
        self.restarts, self.restart_at, self.why = 0, None, ""
        self.actor_error: str | None = None  # why its actor died, if it did
        self.health = health
        self._make_actor, self._before_start, self._local_log = make_actor, before_start, local_log
        self._spawn(log_header, "w" if log_header is None else "a")

    def _spawn(self, log_header: str | None, log_mode: str) -> None:
        """Start the process in a new actor. An actor that dies before the start returns is a
        death like any later one (``poll``: SIGKILL, ``actor_error`` says so), which the supervisor
        restarts by the child's policy or stops the job for: when a lost node or a kill lands is
        luck. Raises ``JobFailed`` naming it if ``before_start`` or the start raised (Ray's message
        holds the cause): that is no death but a launch that cannot work."""
        self.actor = self._make_actor()
        self.pid, self._offset, self._rc, self.actor_error = None, 0, None, None
        self.remote_log: str | None = None  # the log's path on the actor's node, once started
        self._reset_health()
        if not self._local_log:  # this node's copy, filled by _pump
            self._copy = open(self.log_path, log_mode, buffering=1)
        log_dir = str(self.log_path.parent) if self._local_log else None
        try:
            if self._before_start is not None:
                self._before_start(self.actor)
            self.pid, self.remote_log = ray.get(self.actor.start.remote(self.name, self.argv, os.getcwd(), log_dir, self.env,
                                                          not self._local_log, self.expect_exit, log_header))
        except RayActorError as exc:  # its process, if started, died with it (PR_SET_PDEATHSIG)
            self.actor_error = f"lost its Ray actor while it started ({str(exc).strip().splitlines()[0]})"
            self._rc = -9
        except RayError as exc:
            ray.kill(self.actor)
            if not self._local_log:
                self._copy.close()
            raise JobFailed(f"{self.name} could not be started in its Ray actor: {exc}") from None

    def _reset_health(self) -> None:
        """A (re)started process is not up yet: the supervisor asks ``/health`` until it is."""
        self.hung, self.up, self.check = None, False, None
        self.spawned_at = self.check_at = time.monotonic()

    def _pump(self) -> None:
        """Bring the log's new lines here: into the local copy (remote actor), to the console (echo)."""
        if not (self.echo or not self._local_log):
            return
        text, self._offset = ray.get(self.actor.read_log.remote(self._offset))
        if not self._local_log:
            self._copy.write(text)
        if self.echo and text:
            shown = [line for line in text.splitlines(keepends=True) if not line.startswith(("$ ", "===== "))]
            sys.stdout.write("".join(shown))
            sys.stdout.flush()

    def poll(self) -> int | None:
        """The process's exit status, ``None`` while it runs; a dead actor counts as SIGKILL
        (``actor_error`` says why)."""
        if self._rc is not None:
            return self._rc
        try:
            self._pump()
            rc = ray.get(self.actor.poll.remote())
            if rc is not None:
                self._pump()  # its last lines
        except RayActorError as exc:
            self.actor_error = f"lost its Ray actor ({str(exc).strip().splitlines()[0]})"
            rc = -9
        self._rc = rc
        return rc

    @property
    def tail(self) -> list[str]:
        """Its last lines: the actor's ring buffer, or this node's log once the actor is gone."""
        if self.actor_error is None:
            with contextlib.suppress(RayActorError):
                return ray.get(self.actor.tail.remote())
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        except OSError:
            return []

    def respawn(self, log_header: str, argv: list[str] | None = None) -> None:
        """Start the dead process again with ``argv`` (``None``: the same command), in a new actor
        if its actor died."""
        self.restart_at = None
        self.argv = self.argv if argv is None else argv
        if self.actor_error is None:
            with contextlib.suppress(RayActorError):
                ray.get(self.actor.respawn.remote(log_header, self.argv))  # the log goes on: so does its offset
                self._rc = None
                self._reset_health()
                return
        ray.kill(self.actor)
        self._sweep()
        if not self._local_log:
            self._copy.close()
        self._spawn(log_header, "a")

    def kill(self) -> None:
        """SIGKILL the process's group through the actor and wait for it; an actor that died
        took its process with it."""
        with contextlib.suppress(RayActorError):
            ray.get(self.actor.kill.remote())

    def _sweep(self) -> None:
        """SIGKILL the process's group, which may outlive a killed actor (as ``Child.stop`` sweeps);
        from this node only: a remote group died with its actor's ``PR_SET_PDEATHSIG`` leader."""
        # pid None: its actor died inside start, which returns right after the fork; the process died
        # with it (PR_SET_PDEATHSIG), too early to have started children of its own
        if self._local_log and self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def stop(self, grace_s: float) -> None:
        """Stop the process (SIGTERM, SIGKILL of its group after ``grace_s``), then kill the actor."""
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self.actor.stop.remote(grace_s), timeout=grace_s + _STOP_RPC_S)
        with contextlib.suppress(RayActorError, GetTimeoutError):
            if not self._local_log:
                self._pump()  # its last lines; then its node's copy goes (kept if this failed)
                ray.get(self.actor.discard_log.remote(), timeout=_STOP_RPC_S)
        ray.kill(self.actor)
        self._sweep()
        if not self._local_log:
            self._copy.close()


class RankGroup:
    """The trainer's ranks supervised as one child, as ``launcher.local`` supervises torchrun: it
    runs while any rank runs, exits 0 when all did, and otherwise fails with the first failed
    rank's status, name and last lines."""

    def __init__(self, ranks: list[RayChild]):
        self.ranks = ranks
        self.log_path, self.expect_exit = ranks[0].log_path, True
        self.restart, self.restarts, self.restart_at, self.why = None, 0, None, ""
        # not health-checked (nor is torchrun under launcher.local); the fields of Supervised
        self.health, self.hung, self.up, self.check, self.check_at, self.spawned_at = None, None, False, None, 0.0, 0.0
        self.failed: RayChild | None = None

    @property
    def name(self) -> str:
        return "trainer" if self.failed in (None, self.ranks[0]) else f"trainer (rank {self.ranks.index(self.failed)})"

    @property
    def echo(self) -> bool:
        return self.ranks[0].echo

    @echo.setter
    def echo(self, on: bool) -> None:
        self.ranks[0].echo = on

    @property
    def actor_error(self) -> str | None:
        return self.failed.actor_error if self.failed else None

    @property
    def tail(self) -> list[str]:
        return (self.failed or self.ranks[0]).tail

    def poll(self) -> int | None:
        codes = [rank.poll() for rank in self.ranks]
        for rank, rc in zip(self.ranks, codes):
            if rc not in (None, 0):
                self.failed, self.log_path = rank, rank.log_path
                return rc
        return 0 if all(rc == 0 for rc in codes) else None

    def respawn(self, log_header: str) -> None:
        """Never called: the group has no ``Restart`` policy (a failed rank ends the job)."""
        raise RuntimeError("the trainer's ranks are not restarted: a failed rank ends the job")

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def stop(self, grace_s: float) -> None:
        for rank in reversed(self.ranks):
            rank.stop(grace_s)


def _rank_argv(torchrun_argv: list[str]) -> tuple[int, int, list[str]]:
    """(ranks, rendezvous port, one rank's command line) of the ``launcher.torchrun`` command line
    ``launcher.local.run_job`` builds; a rank runs ``PY -u -m <module> <args>`` as torchrun's
    agent starts it."""
    from torch.distributed.run import parse_args

    args = parse_args(torchrun_argv[3:])  # after [PY, "-m", "launcher.torchrun"]
    assert args.module, f"the trainer runs as a module under torchrun: {torchrun_argv}"
    return int(args.nproc_per_node), int(args.master_port), [local.PY, "-u", "-m", args.training_script,
                                                             *args.training_script_args]


class RaySupervisor(Supervisor):
    """``Supervisor`` whose children run in Ray actors placed by ``placement``; the processes are
    named as ``launcher.local.run_job`` names them (``server<i>``, ``queue``, ``trainer``,
    ``worker<w>``), which picks the role's bundle."""

    def __init__(self, log_dir: pathlib.Path, env: dict | None = None, log_header: str | None = None, *,
                 placement: Placement):
        super().__init__(log_dir, env, log_header)
        self.placement = placement
        # what a child on another node gets on top of its own node's environment
        self.job_env = {"PYTHONUNBUFFERED": "1", **(env or {})}

    def start(self, name: str, argv: list[str], env: dict | None = None, echo: bool = False,
              expect_exit: bool = False, stop_leader_first: bool = False,
              restart: Restart | None = None, health: HealthCheck | None = None,
              cpus: tuple[int, ...] = ()) -> Supervised:
        assert not cpus, f"{name}: launcher.ray pins no process (refuse_on_ray refuses the keys before the start)"
        match = _ROLE_OF.fullmatch(name)
        assert match, f"launcher.ray places the processes of launcher.local.run_job; {name!r} is none of them"
        role = match.group(1) or name
        if role == "trainer":
            child = self._start_ranks(argv, env or {}, echo)
        else:
            bundle = self.placement.bundles[role][int(name[len(role):] or 0)]
            child = self._child(name, argv, bundle, env or {}, echo=echo, expect_exit=expect_exit,
                                restart=restart, health=health)
        self.children.append(child)
        return child

    def _child(self, name: str, argv: list[str], bundle: int, env: dict, **kw) -> RayChild:
        here = self.placement.on_driver_node(bundle)
        return RayChild(name, argv, lambda: self.placement.actor(bundle), self.log_dir,
                        {**(self.env if here else self.job_env), **env}, local_log=here,
                        log_header=self.log_header, **kw)

    def _start_ranks(self, torchrun_argv: list[str], env: dict, echo: bool) -> RankGroup:
        nproc, port, argv = _rank_argv(torchrun_argv)
        bundles = self.placement.bundles["trainer"]
        assert len(bundles) == nproc, f"{nproc} ranks, {len(bundles)} trainer bundles"
        nodes = [self.placement.node_of[b][0] for b in bundles]
        # torchrun's rendezvous listens on 127.0.0.1; across nodes, on rank 0's node address
        master = "127.0.0.1" if len(set(nodes)) == 1 else self.placement.node_of[bundles[0]][1]
        gpus = self.placement.resources[bundles[0]].get("GPU", 0)

        def host(actor) -> None:  # rank 0's actor hosts the store, as torchrun's agent does
            ray.get(actor.host_store.remote(master, port, nproc, 600.0))

        ranks = []
        for rank, bundle in enumerate(bundles):
            local_rank = nodes[:rank].count(nodes[rank])
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": master,
                        "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": str(nodes.count(nodes[rank])),
                        # each rank's actor sees its own GPUs only (CUDA_VISIBLE_DEVICES): its device is 0
                        "LOCAL_RANK": "0" if gpus else str(local_rank),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}

            try:
                ranks.append(self._child("trainer" if rank == 0 else f"trainer_rank{rank}", argv, bundle,
                                         rank_env, echo=echo and rank == 0, expect_exit=True,
                                         before_start=host if rank == 0 else None))
            except BaseException:  # the ranks started so far are no child of the supervisor yet
                for started in ranks:
                    started.stop(0.0)
                raise
        return RankGroup(ranks)

    @staticmethod
    def _why(child) -> str:
        return child.actor_error or Supervisor._why(child)


def connect(address: str | None, cfg: Config) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one ``ray start`` runs on this node;
    ``ray://host:port``: Ray Client), or start a local instance on 127.0.0.1 with room for the
    job's bundles and no dashboard."""
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    _, resources = bundles_of(cfg)
    cpus = math.ceil(sum(b["CPU"] for b in resources))
    # "local": a new instance even while another on this machine is recorded as the current one
    # (by `ray start` or ray.cluster_utils.Cluster), which a plain ray.init() would join
    ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False,
             # the job's actors are made at once (Placement): no idle workers started ahead of them
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})


def run_on_ray(cfg: Config, address: str | None) -> int:
    """Connect to Ray, reserve the placement, run the prepared job (``launcher.local.launch`` with
    a ``RaySupervisor``); every actor and the group are gone when it returns, and a local Ray
    instance is shut down. Returns the launcher's exit status."""
    try:
        connect(address, cfg)
        with local.interrupt_on_signals():  # ray.init replaced the SIGTERM handler
            try:
                placement = reserve(cfg)
            except JobFailed as exc:
                print(f"[launcher] job failed: {exc}", file=sys.stderr, flush=True)
                return 1
            try:
                nodes = sorted({ip for _, ip in placement.node_of})
                print(f"[launcher] Ray: {len(placement.resources)} processes placed "
                      f"({cfg.cluster.placement}) on node(s) {', '.join(nodes)}", flush=True)
                try:
                    placed = bind_hosts(cfg, placement)
                except JobFailed as exc:
                    print(f"[launcher] job failed: {exc}", file=sys.stderr, flush=True)
                    return 1
                if placed is not cfg:  # what the children read
                    cfg = placed
                    dump_config(cfg, cfg.run_dir / "config.yaml")
                    print(f"[launcher] across hosts: the servers listen on {cfg.inference.host}, "
                          f"the queue on {cfg.queue.host}", flush=True)
                return local.launch(cfg, supervisor=lambda *a, **kw: RaySupervisor(*a, placement=placement, **kw))
            finally:
                placement.release()
                remove_placement_group(placement.pg)
    except KeyboardInterrupt:
        return local._interrupted()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.ray", description=__doc__,
                                     usage="%(prog)s [-h] [--address ADDRESS] [--overwrite | --resume] "
                                           "config [overrides ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="experiment YAML, e.g. configs/quickstart_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.placement=spread")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join: auto (started with `ray start` on this node) or "
                             "ray://HEAD:10001; default: a local Ray instance on 127.0.0.1")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    start.add_argument("--resume", action="store_true", help="continue RUN_DIR from its checkpoint")
    args = parser.parse_intermixed_args(argv)
    if args.config is None:
        parser.error("the config is required: an experiment YAML, e.g. configs/quickstart_cpu.yaml")
    with local.interrupt_on_signals(), contextlib.ExitStack() as held:  # held: the run lock
        try:
            try:
                cfg = load_config(args.config, args.overrides)
                refuse_on_ray(cfg)
                held.enter_context(local.lock_run(cfg))
                own_gpus = cfg.cluster.gpus_per_server > 0 and cfg.cluster.gpus_per_trainer_rank > 0
                cfg = local.prepare_run(cfg, args.overwrite, args.resume, own_gpus)
            except (ValueError, FileNotFoundError) as exc:
                print(f"[launcher] error: {exc}", file=sys.stderr)
                return 2
            return run_on_ray(cfg, args.address)
        except KeyboardInterrupt:
            return local._interrupted()


if __name__ == "__main__":
    sys.exit(main())
