"""Weight senders against fake servers: separate processes acting as the server ranks.

The fake client (``tests/support/fakes.py``) implements the ``InferenceClient`` calls the senders
use. Its server side is a spawned process per server that joins the weight-update group as rank
``rank_offset`` and receives each bucket by broadcast, exactly as an inference server does behind
``/update_weights_from_distributed``.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal_async.trainer.attention import use_packed_attention
from areal_async.trainer.packed_policy import PackedPolicy
from areal_async.trainer.weight_sync import DiskWeightSender, DistributedWeightSender
from areal_async.weight_group import destroy_weight_group
from tests.support.fakes import AllLive, DiskClient, FakeClient
from areal_async.devices import free_port
from tests.support.servers import start_server

torch.set_num_threads(1)


def _policy(path):
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_packed_attention(lm)
    return PackedPolicy(lm)


def test_distributed_sender_two_servers_receive_trainer_weights(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    client = FakeClient(num_servers=2)
    try:
        # Bucket of 64 KiB: the embedding (384×64 fp32 = 96 KiB) goes alone, so there are several.
        sender = DistributedWeightSender(policy, client, 2, "127.0.0.1", free_port(), 64 * 1024,
                                         torch.float32, torch.device("cpu"))

        async def run():
            await sender.setup()
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.5)  # the servers must get the trainer's current values
            await sender.send(version=1)
            destroy_weight_group(sender.group)  # its name is this process's: free it for the next test

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
    sender.members = [0, 1]  # as after setup: the group holds both servers
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
    # broadcast; the sender must raise then (after one rebuild of the group, which it refuses
    # again), not wait in the broadcast for the group's timeout.
    import threading
    import time

    from areal_async.inference.client import ServerError
    from areal_async.trainer import weight_sync

    released = threading.Event()
    monkeypatch.setattr(weight_sync, "broadcast_", lambda group, tensors: released.wait(20))
    monkeypatch.setattr(weight_sync, "destroy_weight_group", lambda group: None)
    monkeypatch.setattr(weight_sync, "new_weight_group", lambda *args, **kwargs: "group")

    class RefusingClient:
        calls: list[str] = []
        urls = ["http://server-0"]
        servers = AllLive(1)

        async def destroy_weights_update_group(self, server, group_name):
            self.calls.append(f"destroy {group_name}")

        async def init_weights_update_group(self, server, *args):
            self.calls.append(f"join {args[-1]}")

        async def pause(self, mode="abort"):
            self.calls.append("pause")

        async def continue_generation(self):
            self.calls.append("continue_generation")

        async def update_weights_from_distributed(self, server, *args):
            raise ServerError(f"http://server-{server}", 400, "weight_version -1 is not a non-negative integer")

    client = RefusingClient()
    sender = DistributedWeightSender(_policy(tiny_model_dir), client, 1, "127.0.0.1", 0, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    sender.group, sender.members = object(), [0]  # never used: the broadcast is the stub above
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="version 3 failed again .* refused the bucket .* weight version 3"):
            asyncio.run(sender.send(3))
        assert time.perf_counter() - start < 10, "the send waited for the broadcast"
        assert client.calls == ["pause", "destroy weight_update_group", "join weight_update_group_1",
                                "continue_generation"]
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
        urls = ["http://server-0", "http://server-1"]
        servers = AllLive(2)

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


@pytest.mark.parametrize("comes_back", [False, True])
def test_a_server_that_dies_while_joining_leaves_and_the_group_is_built_over_the_rest(tiny_model_dir, monkeypatch,
                                                                                     comes_back):
    # Server 1's join loses its connection (the launcher killed it, hung, mid-join). Gone: setup
    # builds the group again, under the next name, over server 0 alone. Back already (a new
    # process answering /ready): over both, as its process is outside the group.
    import aiohttp

    from areal_async.inference.routing import ServerPool
    from areal_async.trainer import weight_sync

    built: list[tuple[str, int]] = []

    def group(backend, address, port, rank, world_size, group_name, store):
        built.append((group_name, world_size))
        return f"group {group_name}"

    monkeypatch.setattr(weight_sync, "new_weight_group", group)
    monkeypatch.setattr(weight_sync, "host_store", lambda address, port: type("Store", (), {"port": 1})())

    class Pool(ServerPool):
        async def alive(self, server: int) -> bool:
            return server == 0 or comes_back

    class Client:
        urls = ["http://server-0", "http://server-1"]
        servers = Pool(urls, http=None)
        joins: list[tuple[int, str]] = []
        destroyed: list[tuple[int, str]] = []

        async def init_weights_update_group(self, server, address, port, rank, world_size, backend, name):
            self.joins.append((server, name))
            if server == 1 and name == "weight_update_group":
                raise aiohttp.ClientOSError(104, "Connection reset by peer")
            return {"success": True}

        async def destroy_weights_update_group(self, server, name):
            self.destroyed.append((server, name))
            return {"success": True}

    client = Client()
    sender = DistributedWeightSender(_policy(tiny_model_dir), client, 2, "127.0.0.1", 0, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    asyncio.run(sender.setup())
    survivors = [0, 1] if comes_back else [0]
    assert (sender.members, sender.group_name, sender.group) == (
        survivors, "weight_update_group_1", "group weight_update_group_1")
    assert built == [("weight_update_group", 3), ("weight_update_group_1", 1 + len(survivors))]
    assert client.servers.live() == survivors
    assert sorted(client.joins) == sorted([(0, "weight_update_group"), (1, "weight_update_group")]
                                          + [(i, "weight_update_group_1") for i in survivors])
    assert client.destroyed == [(i, "weight_update_group") for i in survivors]


def test_the_disk_sender_skips_a_dead_server_and_brings_a_restarted_one_up_to_date(tiny_model_dir, tmp_path):
    # Two servers that answer SGLang's calls (tests/support/fakes.py's fake_server); server 1
    # dies before update 1, which goes to server 0 alone, without waiting; server 1 comes back on
    # its port with the initial weights (version 0), and update 2 loads on both.
    from aiohttp import web

    from areal_async.inference.client import InferenceClient
    from tests.support.fakes import fake_server, start_fake_server

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
            runner = await start_fake_server(handler(1), port1)  # restarted on the same port
            try:
                await sender.send(2)
            finally:
                await runner.cleanup()
                await client.close()
            return after_1, client.servers.live()

    (loads_1, failures, live_1), live_2 = asyncio.run(main())
    assert loads_1 == [(0, 1)] and failures == 1 and live_1 == [0]
    assert sorted(loads[1:]) == [(0, 2), (1, 2)] and live_2 == [0, 1]


@pytest.mark.timeout(240)
def test_the_distributed_sender_rebuilds_its_group_when_a_server_dies_and_when_it_comes_back(tiny_model_dir,
                                                                                          tmp_path):
    # Two embedded server processes in the weight group. Version 1 reaches both; server 1 is
    # SIGKILLed; version 2 reaches server 0 alone (the group rebuilt over it); server 1 is started
    # again on its port (a new process, initial weights); version 3 reaches both (rebuilt again);
    # server 1 is SIGKILLed during version 4, as its second bucket is announced: the version is
    # sent again, whole, to server 0 alone. Each time every live server serves the trainer's
    # weights bit for bit: its seeded sampled generation equals, token and log-prob, that of a
    # reference server that loaded the same weights from disk.
    from areal_async.inference.client import InferenceClient
    from areal_async.embedded.http_server import InferenceServer, serve
    from areal_async.embedded.loading import load_engine
    from tests.support.models import prompt_ids

    policy = _policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    ports = [free_port(), free_port()]
    procs = [start_server(tiny_model_dir, port) for port in ports]
    generator = torch.Generator().manual_seed(0)

    def perturb():  # new weights for the next version; most outputs change with them
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)

    class Client(InferenceClient):
        kill_at = None  # (server, bucket): SIGKILL that server as that bucket of an update is announced
        buckets = 0

        async def update_weights_from_distributed(self, server, *args, **kwargs):
            if self.kill_at is not None and server == self.kill_at[0]:
                self.buckets += 1
                if self.buckets == self.kill_at[1]:
                    procs[server].kill()
                    procs[server].wait()
            return await super().update_weights_from_distributed(server, *args, **kwargs)

    async def main():
        engine, tokenizer = load_engine(str(tiny_model_dir), "float32", "cpu", 4, 256, deterministic=True)
        async with serve(InferenceServer(engine, tokenizer, str(tiny_model_dir))) as ref_url, \
                InferenceClient([ref_url]) as ref, \
                Client([f"http://127.0.0.1:{p}" for p in ports], backoff_s=0.01, probe_timeout_s=1.0) as client:
            await client.wait_healthy(timeout_s=120)
            reference = DiskWeightSender(policy, ref, 1, str(tiny_model_dir), tmp_path / "weights", torch.float32)
            sender = DistributedWeightSender(policy, client, 2, "127.0.0.1", free_port(), 64 * 1024, torch.float32,
                                             torch.device("cpu"))
            await sender.setup()
            before = await ref.generate(prompt, sampling, "before")
            seen = []

            async def check(version: int) -> None:  # every live server serves the policy's weights exactly
                await reference.send(version)
                want = await ref.generate(prompt, sampling, f"ref-{version}")
                assert want.output_ids != before.output_ids, "the new weights change nothing the check sees"
                for i in client.servers.live():
                    got = await client.generate(prompt, sampling, f"v{version}-{i}", server=i)
                    assert (got.output_ids, got.logprobs, got.versions) == (
                        want.output_ids, want.logprobs, [version] * len(want.output_ids)), (version, i)
                seen.append((version, client.servers.live(), list(sender.members), sender.group_name))

            perturb()
            await sender.send(1)
            await check(1)
            procs[1].kill()
            procs[1].wait()
            perturb()
            await sender.send(2)  # server 1 fails at the pause and leaves routing; the group is rebuilt
            await check(2)
            procs[1] = start_server(tiny_model_dir, ports[1])  # restarted: a new process on the same port
            deadline = asyncio.get_running_loop().time() + 120
            while not await client.servers.answers(1, "/health_generate"):
                assert asyncio.get_running_loop().time() < deadline, "the restarted server did not come up"
                await asyncio.sleep(0.2)
            perturb()
            await sender.send(3)  # server 1 answers the probe, rejoins routing and the rebuilt group
            await check(3)
            perturb()
            client.kill_at = (1, 2)
            await sender.send(4)  # server 1 dies after its first bucket: rebuilt over server 0, sent again
            await check(4)
            destroy_weight_group(sender.group)
            return seen

    try:
        seen = asyncio.run(main())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert seen == [(1, [0, 1], [0, 1], "weight_update_group"), (2, [0], [0], "weight_update_group_1"),
                    (3, [0, 1], [0, 1], "weight_update_group_2"), (4, [0], [0], "weight_update_group_3")]


def test_the_distributed_sender_raises_no_server_left_when_every_server_has_died(tiny_model_dir):
    from areal_async.inference.routing import NoServerLeft, ServerPool

    class Dead(ServerPool):
        async def probe(self, require_version: bool = True) -> list[int]:
            return []  # neither answers

    class Client(FakeClient):
        urls = ["http://server-0", "http://server-1"]

        def __init__(self):
            self.calls = []
            self.servers = Dead(self.urls, http=None)
            for i in range(2):
                self.servers.take_out(i, "killed")

        async def destroy_weights_update_group(self, server, group_name):
            raise AssertionError("a dead server is not asked")

    sender = DistributedWeightSender(_policy(tiny_model_dir), Client(), 2, "127.0.0.1", 0, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    sender.group, sender.members = None, [0, 1]  # built before both died
    with pytest.raises(NoServerLeft, match=r"no inference server left: all 2 .*http://server-0: killed"):
        asyncio.run(sender.send(1))


def test_a_member_restarted_unseen_is_found_by_its_version_and_the_group_rebuilt(tiny_model_dir, monkeypatch):
    # Server 1 died and was restarted between two updates without a call of the client failing:
    # both are live, but server 1 serves version 0 after version 3 was sent. The next update
    # rebuilds the group over both; only server 0 (the survivor) is asked to destroy the old one.
    from areal_async.trainer import weight_sync

    calls: list[tuple] = []
    monkeypatch.setattr(weight_sync, "new_weight_group",
                        lambda backend, address, port, rank, world_size, group_name, store: f"group {group_name}")
    monkeypatch.setattr(weight_sync, "destroy_weight_group", lambda group: calls.append(("rank 0 destroys", group)))
    monkeypatch.setattr(weight_sync, "broadcast_", lambda group, tensors: calls.append(("broadcast", group)))

    class Restarted(AllLive):
        async def version(self, server: int) -> int | None:
            return [3, 0][server]

    class Client:
        urls = ["http://server-0", "http://server-1"]
        servers = Restarted(2)

        async def pause(self, mode="abort"):
            pass

        async def continue_generation(self):
            pass

        async def destroy_weights_update_group(self, server, group_name):
            calls.append(("destroy", server, group_name))

        async def init_weights_update_group(self, server, master_address, master_port, rank_offset, world_size,
                                            backend, group_name):
            calls.append(("join", server, rank_offset, world_size, group_name))

        async def update_weights_from_distributed(self, server, names, dtypes, shapes, version, group_name):
            calls.append(("update", server, version, group_name))

    sender = DistributedWeightSender(_policy(tiny_model_dir), Client(), 2, "127.0.0.1", 1, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    sender.group, sender.members, sender.served = "group weight_update_group", [0, 1], 3  # as after version 3
    asyncio.run(sender.send(4))
    assert calls[:4] == [("rank 0 destroys", "group weight_update_group"), ("destroy", 0, "weight_update_group"),
                         ("join", 0, 1, 3, "weight_update_group_1"), ("join", 1, 2, 3, "weight_update_group_1")]
    # the broadcast's thread and the calls run at once: their order is not fixed
    assert sorted(calls[4:]) == [("broadcast", "group weight_update_group_1"),
                                 ("update", 0, 4, "weight_update_group_1"), ("update", 1, 4, "weight_update_group_1")]
    assert sender.served == 4


def test_a_member_restarted_unseen_before_the_first_version_refuses_once_and_the_group_is_rebuilt(
        tiny_model_dir, monkeypatch):
    # Server 1 was restarted (hung, killed by the launcher) after setup and before version 1, with
    # no call of the trainer's client failing: it serves version 0 like server 0, so only its
    # refusal of the first bucket (it joined no group) shows it. The send rebuilds the group over
    # both and sends the version again.
    from areal_async.inference.client import ServerError
    from areal_async.trainer import weight_sync

    calls: list[tuple] = []
    monkeypatch.setattr(weight_sync, "new_weight_group",
                        lambda backend, address, port, rank, world_size, group_name, store: f"group {group_name}")
    monkeypatch.setattr(weight_sync, "destroy_weight_group", lambda group: calls.append(("rank 0 destroys", group)))
    monkeypatch.setattr(weight_sync, "broadcast_", lambda group, tensors: calls.append(("broadcast", group)))
    joined = {0: "weight_update_group", 1: None}

    class Client:
        urls = ["http://server-0", "http://server-1"]
        servers = AllLive(2)

        async def pause(self, mode="abort"):
            pass

        async def continue_generation(self):
            pass

        async def destroy_weights_update_group(self, server, group_name):
            if joined[server] != group_name:
                raise ServerError(self.urls[server], 400, f"no weight group {group_name!r}")
            joined[server] = None
            calls.append(("destroy", server, group_name))

        async def init_weights_update_group(self, server, master_address, master_port, rank_offset, world_size,
                                            backend, group_name):
            joined[server] = group_name
            calls.append(("join", server, rank_offset, world_size, group_name))

        async def update_weights_from_distributed(self, server, names, dtypes, shapes, version, group_name):
            if joined[server] != group_name:
                raise ServerError(self.urls[server], 400, f"no weight group {group_name!r} (joined: none yet)")
            calls.append(("update", server, version, group_name))

    sender = DistributedWeightSender(_policy(tiny_model_dir), Client(), 2, "127.0.0.1", 1, 1 << 30, torch.float32,
                                     torch.device("cpu"))
    sender.group, sender.members = "group weight_update_group", [0, 1]  # as after setup, none sent yet
    asyncio.run(sender.send(1))
    rebuilt = calls.index(("rank 0 destroys", "group weight_update_group"))
    assert calls[rebuilt:rebuilt + 4] == [
        ("rank 0 destroys", "group weight_update_group"), ("destroy", 0, "weight_update_group"),
        ("join", 0, 1, 3, "weight_update_group_1"), ("join", 1, 2, 3, "weight_update_group_1")]
    assert sorted(calls[rebuilt + 4:]) == [("broadcast", "group weight_update_group_1"),
                                           ("update", 0, 1, "weight_update_group_1"),
                                           ("update", 1, 1, "weight_update_group_1")]
    assert (sender.served, sender.members, sender.group_name) == (1, [0, 1], "weight_update_group_1")
