"""The Ray actor that runs one process of a job on its node (``launcher.ray``).

``ProcessActor`` holds one ``launcher.supervisor.Child``: the same subprocess, process group,
``PR_SET_PDEATHSIG`` and line-by-line log that ``launcher.local`` gives a child, here started by
the actor on whatever node Ray placed it. The launcher calls its methods from its supervision loop
(``launcher.ray.RayChild``); none of them blocks for long, so the actor runs one call at a time,
on its main thread (the thread that started the subprocess, which ``PR_SET_PDEATHSIG`` ties the
child's life to: if the actor is killed, its subprocess is killed with it).

The log is written on the actor's node. On the launcher's node that is ``RUN_DIR/logs/<name>.log``
itself; an actor on another node writes to a node-local directory and the launcher pulls the new
text (``read_log``) into ``RUN_DIR/logs/<name>.log`` on its own node, and deletes the node-local
directory once the process is stopped and its last lines are pulled (``discard_log``).

The rank-0 trainer actor also hosts the ranks' rendezvous store (``host_store``), as torchrun's
agent does: a ``TCPStore`` listening on ``MASTER_ADDR`` only (``areal_async/tcp_store.py``), which
every rank joins as a client (``TORCHELASTIC_USE_AGENT_STORE=True``).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import tempfile

from launcher.supervisor import Child


class ProcessActor:
    """One process of a job, run and watched on the actor's node. Wrapped by ``ray.remote`` in
    ``launcher.ray`` (this module imports no Ray, so it can be read and tested without it)."""

    def __init__(self) -> None:
        self.child: Child | None = None
        self.store = None
        self.own_log_dir: str | None = None  # the node-local log directory ``start`` made, until discarded

    def node(self) -> tuple[str, str]:
        """(this node's Ray id, its IP address)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def host_store(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Host the trainer ranks' rendezvous ``TCPStore`` on ``host:port`` until the actor ends.

        Raises:
            OSError: ``host:port`` cannot be bound (the message says "Address already in use" when
                it is taken, which the launcher reads as a port race).
        """
        from areal_async.tcp_store import hosted_store

        self.store = hosted_store(host, port, world_size, datetime.timedelta(seconds=timeout_s),
                                  multi_tenant=False, wait_for_workers=False)

    def start(self, name: str, argv: list[str], cwd: str, log_dir: str | None, env: dict[str, str],
              own_env: bool, expect_exit: bool, log_header: str | None) -> tuple[int, str]:
        """Start ``argv`` in ``cwd`` with ``env`` (on top of this actor's own environment when
        ``own_env``, i.e. on a node other than the launcher's), its log at ``log_dir/<name>.log``
        (``None``: a new directory under this node's temporary directory); returns its pid and
        its log's path. GPUs that Ray gave this actor are the child's ``CUDA_VISIBLE_DEVICES``."""
        import ray

        env = {**(os.environ if own_env else {}), **env}

        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if log_dir is None:
            log_dir = self.own_log_dir = tempfile.mkdtemp(prefix=f"areal-async-{name}-")
        pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)  # this actor runs this one process only: its working directory is the child's
        self.child = Child(name, argv, pathlib.Path(log_dir), env, expect_exit=expect_exit,
                           log_header=log_header)
        return self.child.proc.pid, str(self.child.log_path)

    def discard_log(self) -> None:
        """Delete the log directory ``start`` made (``log_dir`` ``None``), once the launcher holds its
        lines; a directory given to ``start`` is kept."""
        if self.own_log_dir is not None:
            shutil.rmtree(self.own_log_dir, ignore_errors=True)
            self.own_log_dir = None

    def poll(self) -> int | None:
        """The process's exit status (negative: killed by that signal), ``None`` while it runs."""
        return self.child.poll()

    def tail(self) -> list[str]:
        """Its last lines (``Child.tail``)."""
        return list(self.child.tail)

    def read_log(self, offset: int) -> tuple[str, int]:
        """The log's complete lines after byte ``offset``, and the offset after them."""
        with open(self.child.log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        return data[:end].decode("utf-8", errors="replace"), offset + end

    def kill(self) -> None:
        """SIGKILL the process's group and wait for it (``Child.kill``: a failed health check)."""
        self.child.kill()

    def port_in_use(self, host: str, port: int) -> str | None:
        """Why ``host:port`` cannot be listened on, on this actor's node (the OS's reason), or
        ``None`` if it can (``areal_async.devices.port_in_use``)."""
        from areal_async.devices import port_in_use

        return port_in_use(host, port)

    def respawn(self, log_header: str, argv: list[str] | None = None) -> None:
        """Start the (dead) process again (``Child.respawn``)."""
        self.child.respawn(log_header, argv)

    def stop(self, grace_s: float) -> None:
        """Stop the process and its group (``Child.stop``) and release the store."""
        if self.child is not None:
            self.child.stop(grace_s)
        self.store = None

