"""Where a ``launcher.ray`` job's processes run: one placement group, one bundle per process, and
the address each server and the queue listens on (loopback while their callers share the host,
else their node's, with the job's token). docs/ray.md."""

from __future__ import annotations

import collections

import msgspec
import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_async import auth
from areal_async.config import Config
from launcher.ports import port_of
from launcher.ray_actor import ProcessActor
from launcher.supervisor import JobFailed

ROLES = ("server", "queue", "trainer", "worker")

_RemoteProcess = ray.remote(ProcessActor)  # the actor class, exported to the cluster once


class Placement:
    """The job's placement group and where each bundle landed.

    ``bundles[role]``: the bundle indices of that role's processes, in process order;
    ``resources[i]``: bundle i's resources; ``node_of[i]``: (Ray node id, IP address) of bundle i;
    ``driver_node``, ``driver_ip``: the launcher's node id and IP address (``None`` under Ray
    Client: no node shares its files or its loopback interface).
    """

    def __init__(self, pg, bundles: dict[str, list[int]], resources: list[dict[str, float]],
                 node_of: list[tuple[str, str]], driver_node: str | None, driver_ip: str | None = None):
        self.pg, self.bundles, self.resources = pg, bundles, resources
        self.node_of, self.driver_node, self.driver_ip = node_of, driver_node, driver_ip
        # one actor per bundle made at once, so that Ray starts their worker processes while the
        # launcher waits for the servers (each takes seconds to start); used up by actor()
        self._ready = {i: self._new_actor(i) for i in range(len(resources))}

    def on_driver_node(self, bundle: int) -> bool:
        return self.node_of[bundle][0] == self.driver_node

    def ask(self, bundle: int, method: str, *args):
        """Call ``method`` of the actor made ahead for ``bundle`` (before its process starts)."""
        return ray.get(getattr(self._ready[bundle], method).remote(*args))

    def actor(self, bundle: int):
        """A ``ProcessActor`` in ``bundle``, holding all of its resources: the one made ahead for
        it, the first time, else a new one (a restarted process whose actor died)."""
        return self._ready.pop(bundle, None) or self._new_actor(bundle)

    def release(self) -> None:
        """Kill the actors made ahead and not used (a job that failed during start-up)."""
        for actor in self._ready.values():
            ray.kill(actor)
        self._ready.clear()

    def _new_actor(self, bundle: int):
        res = self.resources[bundle]
        return _RemoteProcess.options(
            num_cpus=res["CPU"], num_gpus=res.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
        ).remote()


def bundles_of(cfg: Config) -> tuple[dict[str, list[int]], list[dict[str, float]]]:
    """One bundle per process: (indices per role, resources per bundle), servers first, then the
    queue, the trainer ranks and the workers. A pinned role's bundles ask for a little of Ray's
    ``node:<ip>`` resource, which only that node has."""
    c = cfg.cluster
    need = {"server": (cfg.inference.num_servers, c.cpus_per_server, c.gpus_per_server, c.server_node),
            "queue": (1, c.cpus_per_queue, 0.0, c.queue_node),
            "trainer": (cfg.trainer.nproc, c.cpus_per_trainer_rank, c.gpus_per_trainer_rank, c.trainer_node),
            "worker": (cfg.rollout.num_workers, c.cpus_per_worker, 0.0, c.worker_node)}
    index: dict[str, list[int]] = {}
    resources: list[dict[str, float]] = []
    for role in ROLES:
        count, cpus, gpus, node = need[role]
        bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {}) | ({f"node:{node}": 0.001} if node else {})
        index[role] = list(range(len(resources), len(resources) + count))
        resources += [dict(bundle) for _ in range(count)]
    return index, resources


def reserve(cfg: Config) -> Placement:
    """Create the job's placement group and wait until Ray granted every bundle.

    Raises:
        JobFailed: not granted within ``cluster.placement_timeout_s`` (the message gives what was
            asked and what the cluster has); the group is removed.
    """
    index, resources = bundles_of(cfg)
    pg = placement_group(resources, strategy=cfg.cluster.placement.upper())
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.placement_timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        total = collections.Counter()
        for bundle in resources:
            total.update(bundle)
        raise JobFailed(f"Ray could not place the job's {len(resources)} processes within "
                        f"cluster.placement_timeout_s={cfg.cluster.placement_timeout_s:g} s: they ask for "
                        f"{dict(total)} (cluster.placement={cfg.cluster.placement}), the cluster has "
                        f"{ray.cluster_resources()}; lower cluster.cpus_per_* / gpus_per_*, unpin "
                        f"cluster.*_node, or add nodes") from None
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    where = placement_group_table(pg)["bundles_to_node_id"]
    node_of = [(where[i], ips[where[i]]) for i in range(len(resources))]
    if ray.util.client.ray.is_connected():
        return Placement(pg, index, resources, node_of, None, None)
    driver = ray.get_runtime_context().get_node_id()
    return Placement(pg, index, resources, node_of, driver, ips[driver])


_LISTENERS = {"server": ("inference", "inference.host", "inference.base_port"),
              "queue": ("queue", "queue.host", "queue.port")}


def bind_hosts(cfg: Config, placement: Placement) -> Config:
    """The config with the servers' and the queue's listening address set for where Ray placed
    them and their callers (the trainer, the workers, the launcher): all on one host (one node
    address), a role keeps its host; otherwise a loopback host (the default ``127.0.0.1``: this
    machine only) becomes the address of the role's node (Ray's node address, what the other
    nodes reach it at), never a wildcard, and the job's token guards it there as on any
    non-loopback address (``areal_async.auth``); a host given explicitly must be that address.
    The ports such a role binds are then checked free on its node, by its actor. One server URL
    per ``inference.host``: the servers share one node address.

    Raises:
        JobFailed: the servers landed on nodes of different addresses (pin them with
            ``cluster.server_node``); a role's host, given and not loopback, is not its node's
            address; or a port it needs is in use there (the message names the key and the fix).
    """
    for role, (section, key, port_key) in _LISTENERS.items():
        bundles = placement.bundles[role]
        ips = sorted({placement.node_of[b][1] for b in bundles})
        host = getattr(cfg, section).host
        if len(ips) > 1:
            raise JobFailed(f"the {role}s landed on nodes {', '.join(ips)}, but their URLs share {key}={host}; "
                            f"pin them to one node: cluster.{role}_node=<its address>")
        callers = [b for caller in ("trainer", "worker") for b in placement.bundles[caller]]
        if {placement.node_of[b][1] for b in bundles + callers} | {placement.driver_ip} == set(ips):
            continue  # one host: its loopback reaches the role
        [ip] = ips
        first = port_of(cfg, port_key)
        ports = [(bundle, first + i, f"{port_key}+{i}" if i else port_key) for i, bundle in enumerate(bundles)]
        cfg = _listen_at(cfg, placement, section, "host", ip, f"the {role}s run", "they", f"cluster.{role}_node",
                         port_key, ports)
    return _bind_weight_group(cfg, placement)


def _bind_weight_group(cfg: Config, placement: Placement) -> Config:
    """``bind_hosts`` for the distributed weight-update group's rendezvous, which trainer rank 0
    hosts and every server joins: loopback while the servers share rank 0's host, else rank 0's
    node address (``trainer.weight_sync_host``; one given must be that address). Its port is checked
    on rank 0's node. Torch's ``TCPStore`` takes no token: on a network address it is open to that
    network, as torchrun's rendezvous is."""
    t = cfg.trainer
    if t.weight_sync != "distributed":
        return cfg
    ip = placement.node_of[placement.bundles["trainer"][0]][1]
    if {placement.node_of[b][1] for b in placement.bundles["server"]} <= {ip}:
        return cfg
    port = t.weight_sync_port
    ports = [(placement.bundles["trainer"][0], port, "trainer.weight_sync_port")] if port else []
    return _listen_at(cfg, placement, "trainer", "weight_sync_host", ip, "trainer rank 0 runs", "it",
                      "cluster.trainer_node", "trainer.weight_sync_port", ports)


def _listen_at(cfg: Config, placement: Placement, section: str, field: str, ip: str, runs: str, they: str,
               pin: str, port_key: str, ports: list[tuple[int, int, str]]) -> Config:
    """The config with ``section.field``, a listening host, set to ``ip`` (the node the listener
    landed on) if it is loopback; each ``(bundle, port, key)`` of ``ports`` checked free there by
    that bundle's actor. ``runs``, ``they``, ``pin``: who listens, for the messages.

    Raises:
        JobFailed: the host, given and not loopback, is not ``ip``; or a port is in use there.
    """
    key = f"{section}.{field}"
    host = getattr(getattr(cfg, section), field)
    if auth.is_loopback(host):
        host = ip
        cfg = msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **{field: ip})})
    elif host != ip:
        raise JobFailed(f"{key}={host}, but {runs} on node {ip}, where {they} cannot listen on it; "
                        f"leave {key}=127.0.0.1 (then the node's address), set {key}={ip}, or pin {pin}={host}")
    for bundle, port, where in ports:
        why = placement.ask(bundle, "port_in_use", host, port)
        if why:
            raise JobFailed(f"port {port} ({where}) is in use on node {ip} ({why}); set "
                            f"{port_key}=<a port free there> (0: chosen on the launcher's node)")
    return cfg
