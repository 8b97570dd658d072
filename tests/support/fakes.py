"""Fakes of the inference side: an HTTP server answering with recorded SGLang shapes, and weight-
update clients whose "servers" are processes of this test.

- ``SGLANG_ABORTED`` / ``SGLANG_FINISHED``: SGLang ``/generate`` responses as recorded (an
  ``input_ids`` request with ``return_logprob``), for handlers to answer with.
- ``fake_server(handler)``: every path served by one aiohttp ``handler`` on a free local port;
  ``start_fake_server(handler, port)`` the same on a given port (a server "restarted" there).
- ``FakeClient``: a ``WeightUpdateClient`` (``areal_async/inference/interface.py``;
  ``tests/test_interfaces.py`` checks it) whose servers are spawned processes that join the
  weight-update group as rank ``rank_offset`` and receive each bucket by broadcast, exactly as an
  inference server does behind ``/update_weights_from_distributed``. ``DiskClient`` records
  ``update_weights_from_disk`` calls and starts no process; ``AllLive`` is their ``servers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp

import torch
from aiohttp import web

from areal_async.devices import free_port

SGLANG_ABORTED = {
    "text": " Two",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "q-0", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
        "prompt_tokens": 3, "weight_version": "4", "completion_tokens": 2, "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    },
}
SGLANG_FINISHED = {
    "text": " apples",
    "output_ids": [9, 2],
    "meta_info": {
        "id": "q-0", "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 5, "weight_version": "5", "completion_tokens": 2, "cached_tokens": 5,
        "output_token_logprobs": [[-1.0, 9, None], [-0.125, 2, None]],
    },
}


async def start_fake_server(handler, port: int) -> web.AppRunner:
    """Serve every path with ``handler`` on ``127.0.0.1:port``; ``await runner.cleanup()`` stops it."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@contextlib.asynccontextmanager
async def fake_server(handler):
    """Serve every path with ``handler`` on a free local port; yields the base URL."""
    port = free_port()
    runner = await start_fake_server(handler, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _server_main(commands, replies):
    """Server side of the group: runs commands until ``stop``; replies ``(ok, payload)``."""
    import torch

    from areal_async.dtypes import dtype_from_name
    from areal_async.weight_group import broadcast_, new_weight_group

    torch.set_num_threads(1)
    group, weights, version = None, {}, None
    while True:
        cmd, args = commands.get()
        if cmd == "stop":
            # numpy arrays pickle by value; torch tensors would be shared through this process's
            # file descriptors, which are gone once it exits (a race with the reader)
            replies.put((True, ({n: t.numpy() for n, t in weights.items()}, version)))
            return
        if cmd == "init":
            addr, port, rank, world = args
            group = new_weight_group("gloo", addr, port, rank, world, timeout_s=60)
            replies.put((True, None))
        elif cmd == "update":
            names, dtypes, shapes, version_now = args
            tensors = [torch.empty(s, dtype=dtype_from_name(d)) for d, s in zip(dtypes, shapes)]
            broadcast_(group, tensors)
            weights.update(zip(names, tensors))
            version = version_now if version_now is not None else version
            replies.put((True, len(names)))


class AllLive:
    """``InferenceClient.servers`` of a client whose servers never die."""

    def __init__(self, n: int):
        self.n = n

    def live(self) -> list[int]:
        return list(range(self.n))

    async def probe(self, require_version: bool = True) -> list[int]:
        return []

    async def version(self, server: int) -> int | None:
        return None  # not asked: no server is restarted

    async def alive(self, server: int) -> bool:
        return True


class FakeClient:
    """A ``WeightUpdateClient`` backed by server processes (the module docstring says how)."""

    servers = AllLive(2)
    urls = ["fake://server0", "fake://server1"]  # what error messages name

    async def each_live(self, call):
        live = self.servers.live()
        return dict(zip(live, await asyncio.gather(*(call(i) for i in live))))

    def __init__(self, num_servers: int):
        ctx = mp.get_context("spawn")
        self.pipes = [(ctx.Queue(), ctx.Queue()) for _ in range(num_servers)]
        self.procs = [ctx.Process(target=_server_main, args=p, daemon=True) for p in self.pipes]
        for proc in self.procs:
            proc.start()
        self.calls: list[str] = []
        self.bucket_sizes: list[int] = []
        self.disk_updates: list[tuple[int, str, int]] = []

    async def _ask(self, server: int, cmd: str, args=None):
        commands, replies = self.pipes[server]
        commands.put((cmd, args))
        ok, payload = await asyncio.to_thread(replies.get, True, 60)
        return payload

    async def init_weights_update_group(self, server, master_address, master_port, rank_offset, world_size,
                                        backend, group_name):
        assert backend == "gloo" and rank_offset == 1 + server
        await self._ask(server, "init", (master_address, master_port, rank_offset, world_size))

    async def destroy_weights_update_group(self, server, group_name):
        raise AssertionError("no server left or came back: the group is never rebuilt")

    async def update_weights_from_distributed(self, server, names, dtypes, shapes, version, group_name):
        n = await self._ask(server, "update", (names, dtypes, shapes, version))
        if server == 0:
            self.bucket_sizes.append(n)

    async def update_weights_from_disk(self, server, path, version):
        self.disk_updates.append((server, path, version))

    async def pause(self, mode="abort"):
        self.calls.append("pause")

    async def continue_generation(self):
        self.calls.append("continue_generation")

    def stop(self):
        out = []
        for (commands, replies), proc in zip(self.pipes, self.procs):
            commands.put(("stop", None))
            out.append(replies.get(timeout=60))
            proc.join(timeout=30)
        return [({n: torch.from_numpy(a) for n, a in weights.items()}, version) for _, (weights, version) in out]


class DiskClient(FakeClient):
    """Records ``update_weights_from_disk`` calls; no server processes."""

    def __init__(self):
        self.calls, self.disk_updates = [], []
