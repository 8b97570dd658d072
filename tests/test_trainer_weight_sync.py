"""Weight senders against fake servers: separate processes acting as the server ranks.

The fake client implements the ``InferenceClient`` calls the senders use. Its server side is a
spawned process per server that joins the weight-update group as rank ``rank_offset`` and
receives each bucket by broadcast, exactly as an inference server does behind
``/update_weights_from_distributed``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import pathlib
import socket

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.packed_policy import PackedPolicy
from areal_async.trainer.weight_sync import DiskWeightSender, DistributedWeightSender

torch.set_num_threads(1)


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


class FakeClient:
    """A ``WeightUpdateClient`` (``inference/interface.py``; ``tests/test_interfaces.py`` checks it),
    backed by server processes."""

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy(path):
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_packed_attention(lm)
    return PackedPolicy(lm)


def test_distributed_sender_two_servers_receive_trainer_weights(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    client = FakeClient(num_servers=2)
    try:
        # Bucket of 64 KiB: the embedding (384×64 fp32 = 96 KiB) goes alone, so there are several.
        sender = DistributedWeightSender(policy, client, 2, "127.0.0.1", _free_port(), 64 * 1024,
                                         torch.float32, torch.device("cpu"))

        async def run():
            await sender.setup()
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.5)  # the servers must get the trainer's current values
            await sender.send(version=1)

        asyncio.run(run())
    finally:
        results = client.stop()
    expected = dict(policy.lm.named_parameters())
    assert len(client.bucket_sizes) > 1 and sum(client.bucket_sizes) == len(expected)
    assert client.calls == ["pause", "continue_generation"]
    for weights, version in results:
        assert version == 1
        assert weights.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(weights[name], t.detach()), name


def test_disk_sender_writes_loadable_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    policy = _policy(tiny_model_dir)
    with torch.no_grad():
        policy.lm.model.norm.weight.fill_(3.0)
    client = DiskClient()
    sender = DiskWeightSender(policy, client, 2, str(tiny_model_dir), tmp_path / "weights", torch.bfloat16)
    deleted, rmtree = [], shutil.rmtree

    def recording_rmtree(path, *args, **kwargs):
        deleted.append(pathlib.Path(path).name)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    asyncio.run(sender.send(1))
    asyncio.run(sender.send(2))
    assert [(s, v) for s, _, v in client.disk_updates] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert not (tmp_path / "weights" / "v1").exists(), "the previous version's directory is removed"
    # renamed before its files go, so a directory named v1 is never half there (a restarted
    # server starts from the newest one, launcher/restart_weights.py)
    assert "v1" not in deleted and "v1.removed" in deleted
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "v2")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.norm.weight, torch.full_like(loaded.model.norm.weight, 3.0))
    # the written weights are the trainer's rounded once to bf16 (round to nearest even), exactly
    served = dict(loaded.named_parameters())
    for name, p in policy.lm.named_parameters():
        assert torch.equal(served[name], p.detach().to(torch.bfloat16)), name
    assert (tmp_path / "weights" / "v2" / "tokenizer_config.json").exists()


def test_disk_sender_keeps_the_base_models_generation_config_and_tokenizer_files(multi_eos_model_dir, tmp_path):
    # the servers load these directories: without the base's generation_config.json they fall back
    # to config.json's single eos id (2) where the base lists [2, 0]
    from transformers import GenerationConfig

    sender = DiskWeightSender(_policy(multi_eos_model_dir), DiskClient(), 1, str(multi_eos_model_dir),
                              tmp_path / "weights", torch.bfloat16)
    asyncio.run(sender.send(1))
    served = tmp_path / "weights" / "v1"
    assert GenerationConfig.from_pretrained(served).eos_token_id == [2, 0]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (served / name).read_bytes() == (multi_eos_model_dir / name).read_bytes(), name
    assert json.loads((served / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("interrupt", [True, False])
def test_distributed_sender_without_interruption_sends_one_bucket_unpaused(tiny_model_dir, interrupt):
    # without a pause each server call waits for the generations in flight on its own (SGLang's
    # model-update lock), so a second bucket would let requests held behind the first run on
    # half-updated weights: the whole model goes in one call (the group's broadcast is left out)
    policy = _policy(tiny_model_dir)
    client = DiskClient()
    sender = DistributedWeightSender(policy, client, 2, "127.0.0.1", 0, 64 * 1024, torch.float32,
                                     torch.device("cpu"), interrupt_on_update=interrupt)
    buckets = []

    async def record(bucket, version):
        buckets.append(([name for name, _ in bucket], version))

    sender._send_bucket = record
    asyncio.run(sender.send(3))
    names = [name for name, _ in policy.lm.named_parameters()]
    assert [n for b, _ in buckets for n in b] == names and {v for _, v in buckets} == {3}
    assert (len(buckets) > 1 if interrupt else len(buckets) == 1), [len(b) for b, _ in buckets]  # 64 KiB buckets
    assert client.calls == (["pause", "continue_generation"] if interrupt else [])


@pytest.mark.parametrize("interrupt", [True, False])
def test_disk_sender_pauses_only_to_interrupt(tiny_model_dir, tmp_path, interrupt):
    client = DiskClient()
    sender = DiskWeightSender(_policy(tiny_model_dir), client, 2, str(tiny_model_dir), tmp_path / "weights",
                              torch.bfloat16, interrupt_on_update=interrupt)
    asyncio.run(sender.send(1))
    assert [(s, v) for s, _, v in client.disk_updates] == [(0, 1), (1, 1)]
    assert client.calls == (["pause", "continue_generation"] if interrupt else [])


def test_disk_sender_writes_send_dtype_bitwise(tiny_model_dir, tmp_path):
    policy = _policy(tiny_model_dir)
    client = DiskClient()
    sender = DiskWeightSender(policy, client, 2, str(tiny_model_dir), tmp_path / "weights", torch.bfloat16)
    asyncio.run(sender.setup())
    asyncio.run(sender.send(1))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1 / 3)  # version 2 must carry the new values; most sums need rounding to bf16
    asyncio.run(sender.send(2))
    paths = {v: pathlib.Path(path) for _, path, v in client.disk_updates}
    assert paths[2] == (tmp_path / "weights" / "v2").resolve()
    assert not paths[1].exists(), "the previous version's directory is removed once the servers serve v2"
    files = sorted(paths[2].glob("*.safetensors"))
    assert len(files) == 4, files  # written in parallel, one file per writer thread
    written = {}
    for f in files:
        written |= load_file(f)
    expected = {name: p.detach().to(torch.bfloat16) for name, p in policy.lm.named_parameters()}
    assert written.keys() == expected.keys()  # the tied LM head is stored once, as the embedding
    index = json.loads((paths[2] / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == expected.keys()
    assert set(index["weight_map"].values()) == {f.name for f in files}
    for name, t in expected.items():
        assert written[name].dtype == torch.bfloat16, f"{name}: {written[name].dtype}"
        assert torch.equal(written[name].view(torch.int16), t.view(torch.int16)), name  # bitwise
    assert json.loads((paths[2] / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"], "no staging or old directory is left"


def test_a_refused_bucket_fails_the_send_at_once(tiny_model_dir, monkeypatch):
    # A server that answers /update_weights_from_distributed with an error never joins the
    # broadcast; the sender must raise then, not wait in the broadcast for the group's timeout.
    import threading
    import time

    from areal_async.inference.client import ServerError
    from areal_async.trainer import weight_sync

    released = threading.Event()
    monkeypatch.setattr(weight_sync, "broadcast_", lambda group, tensors: released.wait(20))

    class RefusingClient:
        calls: list[str] = []
        servers = AllLive(1)

        async def pause(self, mode="abort"):
            self.calls.append("pause")

        async def continue_generation(self):
            self.calls.append("continue_generation")

        async def update_weights_from_distributed(self, server, *args):
            raise ServerError(f"http://server-{server}", 400, "weight_version -1 is not a non-negative integer")

    client = RefusingClient()
    sender = DistributedWeightSender(_policy(tiny_model_dir), client, 1, "127.0.0.1", 0, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    sender.group = object()  # never used: the broadcast is the stub above
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="refused the bucket .* weight version 3"):
            asyncio.run(sender.send(3))
        assert time.perf_counter() - start < 10, "the send waited for the broadcast"
        assert client.calls == ["pause", "continue_generation"]
    finally:
        released.set()


def test_a_refused_join_fails_the_setup_at_once(tiny_model_dir, monkeypatch):
    # A server that answers /init_weights_update_group with an error never connects to the
    # rendezvous; setup must raise then, not wait for the rendezvous to time out.
    import threading
    import time

    from areal_async.inference.client import ServerError
    from areal_async.trainer import weight_sync

    released = threading.Event()
    monkeypatch.setattr(weight_sync, "new_weight_group", lambda *args, **kwargs: released.wait(20))

    class RefusingClient:
        async def init_weights_update_group(self, server, *args):
            raise ServerError(f"http://server-{server}", 400, "rank_offset must be >= 1")

    sender = DistributedWeightSender(_policy(tiny_model_dir), RefusingClient(), 2, "127.0.0.1", 0, 1 << 30,
                                     torch.float32, torch.device("cpu"))
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="refused to join the weight group"):
            asyncio.run(sender.setup())
        assert time.perf_counter() - start < 10, "setup waited for the rendezvous"
    finally:
        released.set()


def test_the_disk_sender_skips_a_dead_server_and_brings_a_restarted_one_up_to_date(tiny_model_dir, tmp_path):
    # Two servers that answer SGLang's calls (tests/test_client.py's recording server); server 1
    # dies before update 1, which goes to server 0 alone, without waiting; server 1 comes back on
    # its port with the initial weights (version 0), and update 2 loads on both.
    from aiohttp import web

    from areal_async.inference.client import InferenceClient
    from tests.test_client import fake_server

    loads: list[tuple[int, int]] = []

    def handler(server: int):
        async def reply(request: web.Request) -> web.Response:
            if request.path == "/update_weights_from_disk":
                loads.append((server, int((await request.json())["weight_version"])))
                return web.json_response({"success": True, "message": "", "num_paused_requests": 0})
            if request.path == "/get_weight_version":
                return web.json_response({"weight_version": "0"})
            return web.json_response({"success": True}) if request.method == "POST" else web.Response(text="")
        return reply

    async def main():
        async with fake_server(handler(0)) as url0:
            async with fake_server(handler(1)) as url1:
                client = InferenceClient([url0, url1], backoff_s=0.01, probe_timeout_s=1.0)
            sender = DiskWeightSender(_policy(tiny_model_dir), client, 2, str(tiny_model_dir), tmp_path / "weights",
                                      torch.float32)
            await sender.send(1)  # server 1 is gone
            after_1 = (list(loads), client.server_failures, client.servers.live())
            port1 = int(url1.rsplit(":", 1)[1])
            runner = web.AppRunner(_app(handler(1)))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port1).start()  # restarted on the same port
            try:
                await sender.send(2)
            finally:
                await runner.cleanup()
                await client.close()
            return after_1, client.servers.live()

    (loads_1, failures, live_1), live_2 = asyncio.run(main())
    assert loads_1 == [(0, 1)] and failures == 1 and live_1 == [0]
    assert sorted(loads[1:]) == [(0, 2), (1, 2)] and live_2 == [0, 1]


def _app(handler):
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


def test_the_distributed_sender_names_the_fix_when_a_server_has_left(tiny_model_dir):
    # The weight group was built with both servers; one has died (out of routing): the send
    # stops at once, naming trainer.weight_sync=disk, and resumes the live server it paused.
    class OneLeft(AllLive):
        def live(self) -> list[int]:
            return [0]

    class Client:
        urls = ["http://server-0", "http://server-1"]
        servers = OneLeft(2)
        calls: list[str] = []

        async def pause(self, mode="abort"):
            self.calls.append("pause")

        async def continue_generation(self):
            self.calls.append("continue_generation")

    client = Client()
    sender = DistributedWeightSender(_policy(tiny_model_dir), client, 2, "127.0.0.1", 0, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"\['http://server-1'\] left routing .* set trainer.weight_sync=disk"):
        asyncio.run(sender.send(1))
    assert client.calls == ["pause", "continue_generation"]
