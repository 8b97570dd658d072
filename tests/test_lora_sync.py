"""Adapter-only (LoRA) weight sync, trainer to embedded server, against peft on the tiny fp32 model.

What would fail if an update silently did not reach the engine: after each update the server's
``weight_version`` moves AND its greedy tokens and log-probs for a fixed prompt change and equal a
reference computed by peft (unmerged adapter, fp32, tight tolerance); the adapter tensors the
engine holds equal the trainer's bit for bit. Both senders: disk (in-process server; peft loads
the written directory too) and distributed (a server process joined over gloo, its held tensors
dumped by a test route). The prefix cache: a prompt cached under version v is not reused at v + 1
(its log-probs would be v's otherwise). Also: the SGLang-style update (unload, load,
``update_weight_version``) against the embedded server, ``lora_path`` on ``/generate``, refusals,
and ``update_bytes`` against peft's own state dict.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.devices import free_port
from areal_async.inference.client import InferenceClient
from areal_async.trainer.lora_sync import DiskAdapterSender, DistributedAdapterSender, update_bytes, write_adapter_dir
from areal_async.weight_group import destroy_weight_group
from tests.support.adapters import (GREEDY, TOKENS, R, adapter_config, adapter_items, assert_serves, peft_policy,
                                    reference, served, step)
from tests.support.models import prompt_ids
from tests.support.servers import running

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_holds(engine_tensors: dict[str, torch.Tensor], model) -> None:
    """The engine's adapter tensors are the trainer's, bit for bit."""
    sent = dict(adapter_items(model)())
    assert engine_tensors.keys() == sent.keys()
    for name, t in sent.items():
        got = engine_tensors[name].cpu()
        assert got.dtype == t.dtype and torch.equal(got.view(torch.int32), t.view(torch.int32)), name


# ---- disk, in-process server ----------------------------------------------------------------------

def test_disk_adapter_updates_reach_the_engine_and_equal_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel

    policy = peft_policy(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url]) as client:
                before = await api.generate(prompt, **GREEDY)
                assert_serves(before, base, prompt, 0)
                sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 1,
                                           tmp_path / "adapters")
                await sender.setup()
                await sender.send(1)
                assert await client.get_weight_version(0) == 1
                first = await api.generate(prompt, **GREEDY)
                assert served(first)[0] != served(before)[0], "the adapter must change the greedy tokens"
                assert_serves(first, policy, prompt, 1)
                assert_holds(engine.adapter.tensors, policy)
                # peft loads the written directory and serves the same tokens
                loaded = PeftModel.from_pretrained(
                    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                    tmp_path / "adapters" / "v1").eval()
                assert reference(loaded, prompt)[0] == served(first)[0]
                # the prompt is cached under version 1 now: a repeat reuses it
                again = await api.generate(prompt, **GREEDY)
                assert served(again)[3] > 0
                step(policy, seed=1)
                await sender.send(2)
                assert await client.get_weight_version(0) == 2
                assert not (tmp_path / "adapters" / "v1").exists()
                second = await api.generate(prompt, **GREEDY)
                # nothing computed under version 1 is reused at version 2 (else these log-probs
                # would mix the two adapters and miss the reference)
                assert served(second)[3] == 0
                assert served(second)[0] != served(first)[0]
                assert_serves(second, policy, prompt, 2)
                assert_holds(engine.adapter.tensors, policy)

    asyncio.run(main())


def test_an_adapter_sent_in_bf16_is_held_bit_for_bit_and_merged_in_fp32(tiny_model_dir, tmp_path):
    """``save_dtype`` bfloat16 (the servers' dtype in deployments): the engine holds the trainer's
    tensors rounded once to bf16, exactly, and serves what peft serves with those rounded values."""
    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    rounded = peft_policy(tiny_model_dir)
    with torch.no_grad():  # the policy with its adapter rounded to bf16 (the base stays fp32)
        for (name, p), (_, q) in zip(rounded.named_parameters(), policy.named_parameters()):
            p.copy_(q.to(torch.bfloat16).float() if "lora_" in name else q)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url]) as client:
                sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 1,
                                           tmp_path / "adapters", save_dtype=torch.bfloat16)
                await sender.send(1)
                sent = dict(adapter_items(policy)())
                for name, t in engine.adapter.tensors.items():
                    assert t.dtype == torch.bfloat16 and torch.equal(t, sent[name].to(torch.bfloat16)), name
                assert_serves(await api.generate(prompt, **GREEDY), rounded, prompt, 1)

    asyncio.run(main())


def test_a_prefix_cached_under_the_previous_adapter_is_not_reused_even_without_a_flush(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """The version key alone keeps version v's KV from version v + 1 (the flush is a second guard)."""
    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            monkeypatch.setattr(type(engine), "flush_cache", lambda self: None)
            async with InferenceClient([api.url]) as client:
                await api.generate(prompt, **GREEDY)
                await api.generate(prompt, **GREEDY)
                sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 1,
                                           tmp_path / "adapters")
                await sender.send(1)
                resp = await api.generate(prompt, **GREEDY)
                assert served(resp)[3] == 0
                assert_serves(resp, policy, prompt, 1)

    asyncio.run(main())


def test_the_sglang_sequence_unload_load_update_weight_version_works_on_the_embedded_server(tiny_model_dir,
                                                                                           tmp_path):
    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            async with InferenceClient([api.url], lora_path="policy") as client:
                sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 1,
                                           tmp_path / "adapters", backend="sglang")
                await sender.send(1)  # its unload finds none loaded: a 400, passed over
                assert await client.get_weight_version(0) == 1
                out = await client.generate(prompt, dict(GREEDY), rid="a")  # names lora_path "policy"
                assert out.versions == [1] * TOKENS and out.output_ids == reference(policy, prompt)[0]
                step(policy, seed=3)
                await sender.send(2)
                assert await client.get_weight_version(0) == 2
                resp = await api.generate(prompt, **GREEDY)
                assert_serves(resp, policy, prompt, 2)
                assert_holds(engine.adapter.tensors, policy)
        with pytest.raises(ValueError, match="interrupt_on_update"):
            DiskAdapterSender(adapter_items(policy), {}, None, 1, tmp_path, interrupt_on_update=False, backend="sglang")

    asyncio.run(main())


def test_lora_endpoints_refuse_and_restore(tiny_model_dir, tmp_path):
    policy = peft_policy(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = prompt_ids(tiny_model_dir)
    path = write_adapter_dir(tmp_path / "a", dict(adapter_items(policy)()), adapter_config(policy))

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            status, out = await api.post("/generate", {"input_ids": prompt, "lora_path": "policy"})
            assert status == 400 and "not a loaded LoRA adapter" in json.dumps(out)
            status, out = await api.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(path)})
            assert status == 200 and out["success"] and out["loaded_adapters"] == {"policy": str(path)}
            assert out["weight_version"] == "0"  # SGLang's load carries no version: it stays
            status, out = await api.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(path)})
            assert status == 400 and "already loaded" in out["error_message"]
            status, out = await api.post("/load_lora_adapter", {"lora_name": "other", "lora_path": str(path)})
            assert status == 400 and "holds 'policy'" in out["error_message"]
            status, out = await api.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
            assert status == 400 and "unload the adapter first" in out["message"]
            resp = await api.generate(prompt, **GREEDY)
            assert_serves(resp, policy, prompt, 0)
            status, _ = await api.post("/generate", {"input_ids": prompt, "lora_path": "policy",
                                                     "sampling_params": {"max_new_tokens": 1}})
            assert status == 200
            status, out = await api.post("/update_weight_version", {"new_version": "3", "abort_all_requests": False})
            assert status == 200 and out["new_version"] == "3"
            status, out = await api.post("/unload_lora_adapter", {"lora_name": "policy"})
            assert status == 200 and out["loaded_adapters"] == {}
            assert engine.adapter is None
            assert_serves(await api.generate(prompt, **GREEDY), base, prompt, 3)  # the base weights, bit for bit
            status, out = await api.post("/unload_lora_adapter", {"lora_name": "policy"})
            assert status == 400 and "does not exist" in out["error_message"]
            bad = {**adapter_config(policy), "use_dora": True}
            (path / "adapter_config.json").write_text(json.dumps(bad, default=sorted))
            status, out = await api.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(path)})
            assert status == 400 and "DoRA" in out["error_message"]
            assert engine.adapter is None and engine.weight_version == 3

    asyncio.run(main())


# ---- distributed, a server process ---------------------------------------------------------------

_SERVER = r"""
import asyncio, sys
from aiohttp import web
from safetensors.torch import save_file
import torch
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine

torch.set_num_threads(1)
model_dir, port = sys.argv[1], int(sys.argv[2])
engine, tok = load_engine(model_dir, "float32", "cpu", 4, 256)


class Server(InferenceServer):
    def app(self):
        app = super().app()

        async def dump(request):  # test only: the adapter tensors the engine holds
            path = (await request.json())["path"]
            save_file({n: t.contiguous().cpu() for n, t in engine.adapter.tensors.items()}, path)
            return web.json_response({"ok": True})

        app.router.add_route("POST", "/test_dump_adapter", dump)
        return app


async def main():
    async with serve(Server(engine, tok, model_dir), port=port):
        await asyncio.Event().wait()

asyncio.run(main())
"""


def test_distributed_adapter_updates_reach_a_server_process_bit_for_bit(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    port, buckets = free_port(), []
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(tiny_model_dir), str(port)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with InferenceClient([url]) as client:
            await client.wait_healthy(120)

            async def check(version: int) -> None:
                assert await client.get_weight_version(0) == version
                status, resp = await post("/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                                        "return_logprob": True})
                assert status == 200, resp
                assert_serves(resp, policy, prompt, version)
                dump = tmp_path / f"held{version}.safetensors"
                assert (await post("/test_dump_adapter", {"path": str(dump)}))[0] == 200
                assert_holds(load_file(dump), policy)

            async def post(path, body):
                async with client._http().post(url + path, json=body) as r:
                    return r.status, await r.json()

            # 1.5 KiB buckets: some linear's lora_A and lora_B land in different buckets
            sender = DistributedAdapterSender(adapter_items(policy), adapter_config(policy), client, 1, "127.0.0.1",
                                              free_port(), 1536, torch.device("cpu"))
            announce = sender._announce

            async def recording(server, names, *args):
                buckets.append(names)
                return await announce(server, names, *args)

            sender._announce = recording
            await sender.setup()
            await sender.send(1)
            bucket_of = {n: i for i, names in enumerate(buckets) for n in names}
            assert any(bucket_of[n] != bucket_of[n.replace("lora_A", "lora_B")] for n in bucket_of if "lora_A" in n)
            await check(1)
            step(policy, seed=2)
            await sender.send(2)
            await check(2)
            destroy_weight_group(sender.group)

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert b"Traceback" not in err, err.decode()[-3000:]


def test_update_bytes_counts_peft_adapter_tensors(tiny_model_dir):
    from transformers import AutoConfig

    policy = peft_policy(tiny_model_dir)
    sizes = update_bytes(AutoConfig.from_pretrained(tiny_model_dir), R, full_dtype=torch.float32)
    sent = dict(adapter_items(policy)())
    assert sizes["adapter_params"] == sum(t.numel() for t in sent.values())
    assert sizes["adapter"] == sum(t.numel() * t.element_size() for t in sent.values())
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert sizes["full_params"] == sum(p.numel() for p in full.parameters())


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_a_dead_server_is_skipped_and_a_restarted_one_gets_the_current_adapter(tiny_model_dir, tmp_path, backend):
    """Server 1 dies before version 1 (sent to server 0 alone), comes back on its port from the
    base model at version 0, and version 2, the whole adapter again, brings it up to date."""
    import aiohttp

    from areal_async.embedded.http_server import InferenceServer, serve
    from areal_async.embedded.loading import load_engine
    from tests.support.servers import Api

    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)

    def server():
        engine, tok = load_engine(str(tiny_model_dir), "float32", "cpu", 4, 256)
        return engine, InferenceServer(engine, tok, str(tiny_model_dir))

    async def main():
        _, s0 = server()
        async with serve(s0) as url0:
            port1 = free_port()
            async with serve(server()[1], port=port1) as url1:
                client = InferenceClient([url0, url1], backoff_s=0.01, probe_timeout_s=1.0)
            sender = DiskAdapterSender(adapter_items(policy), adapter_config(policy), client, 2,
                                       tmp_path / "adapters", backend=backend)
            try:
                await sender.send(1)  # server 1 is gone: skipped, not waited for
                assert client.servers.live() == [0] and await client.get_weight_version(0) == 1
                engine1, s1 = server()  # restarted: the base model, version 0
                async with serve(s1, port=port1), aiohttp.ClientSession() as http:
                    step(policy, seed=4)
                    await sender.send(2)
                    assert client.servers.live() == [0, 1]
                    assert await client.get_weight_version(1) == 2
                    assert_holds(engine1.adapter.tensors, policy)
                    assert_serves(await Api(url1, http).generate(prompt, **GREEDY), policy, prompt, 2)
                    assert_serves(await Api(url0, http).generate(prompt, **GREEDY), policy, prompt, 2)
            finally:
                await client.close()

    asyncio.run(main())


@pytest.mark.gpu
def test_on_cuda_the_merged_adapter_is_what_the_cuda_graphs_serve(tiny_qwen3_dir, tmp_path):
    """bf16 on CUDA, CUDA graphs on: the adapter server's greedy tokens and log-probs equal those of a
    fresh server whose full weights are the adapter server's merged ones, bit for bit, and differ
    from the base model's (a graph still reading the old weights would serve the base)."""
    import aiohttp

    from areal_async.embedded.http_server import InferenceServer, serve
    from areal_async.embedded.loading import load_engine
    from areal_async.trainer.checkpoint import hf_metadata_files, write_hf_directory
    from tests.support.servers import Api

    policy = peft_policy(tiny_qwen3_dir)
    prompt = prompt_ids(tiny_qwen3_dir)
    adapter_dir = write_adapter_dir(tmp_path / "a", dict(adapter_items(policy)()), adapter_config(policy))

    async def outputs(engine, tok, load_adapter: bool):
        async with serve(InferenceServer(engine, tok, str(tiny_qwen3_dir))) as url, aiohttp.ClientSession() as http:
            api = Api(url, http)
            before = served(await api.generate(prompt, **GREEDY))
            if load_adapter:
                status, out = await api.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(adapter_dir),
                                                                    "weight_version": "1"})
                assert status == 200, out
            after = served(await api.generate(prompt, **GREEDY))
            return before, after

    engine, tok = load_engine(str(tiny_qwen3_dir), "bfloat16", "cuda", 4, 256)
    assert engine.forward.graphs is not None
    base, merged = asyncio.run(outputs(engine, tok, True))
    assert merged[0] != base[0]
    kept = engine.adapter.base  # the base weights the merge starts from: on the host, not a second copy on the card
    assert len(kept) == 14 and all(t.device.type == "cpu" and t.is_pinned() for t in kept.values())
    weights = {n: t.detach().cpu() for n, t in engine.forward.model.named_parameters()}
    full = write_hf_directory(tmp_path / "full", weights, hf_metadata_files(str(tiny_qwen3_dir), torch.bfloat16))
    engine2, tok2 = load_engine(str(full), "bfloat16", "cuda", 4, 256)
    fresh, _ = asyncio.run(outputs(engine2, tok2, False))
    assert fresh[0] == merged[0] and torch.equal(fresh[1], merged[1])


@pytest.mark.slow  # 10 s; the in-process restart test above covers the sender's rule
@pytest.mark.timeout(300)
def test_the_distributed_adapter_sender_brings_a_restarted_server_process_up_to_date(tiny_model_dir, tmp_path):
    """Two server processes; server 1 is killed before version 1 (the group is rebuilt over server 0),
    started again on its port from the base model, and version 2 rebuilds the group over both and
    sends it the whole adapter: its version, tensors and outputs are version 2's."""
    from safetensors.torch import load_file

    policy = peft_policy(tiny_model_dir)
    prompt = prompt_ids(tiny_model_dir)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _SERVER, str(tiny_model_dir), str(ports[i])],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)

    procs = [start(0), start(1)]

    async def main():
        async with InferenceClient(urls, backoff_s=0.05, probe_timeout_s=2.0) as client:
            await client.wait_healthy(120)

            async def post(i, path, body):
                async with client._http().post(urls[i] + path, json=body) as r:
                    return r.status, await r.json()

            sender = DistributedAdapterSender(adapter_items(policy), adapter_config(policy), client, 2, "127.0.0.1",
                                              free_port(), 1 << 20, torch.device("cpu"))
            await sender.setup()
            procs[1].kill()
            procs[1].wait()
            await sender.send(1)
            assert client.servers.live() == [0] and await client.get_weight_version(0) == 1
            procs[1] = start(1)  # restarted: the base model, version 0
            for _ in range(240):
                if await client.servers.answers(1, "/health"):
                    break
                await asyncio.sleep(0.5)
            step(policy, seed=5)
            await sender.send(2)
            assert client.servers.live() == [0, 1] and sender.rebuilds == 2
            for i in (0, 1):
                assert await client.get_weight_version(i) == 2
                status, resp = await post(i, "/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                                           "return_logprob": True})
                assert status == 200, resp
                assert_serves(resp, policy, prompt, 2)
                dump = tmp_path / f"held{i}.safetensors"
                assert (await post(i, "/test_dump_adapter", {"path": str(dump)}))[0] == 200
                assert_holds(load_file(dump), policy)
            destroy_weight_group(sender.group)

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_lora_paths_merges_an_adapter_directory_before_serving(tiny_model_dir, tmp_path):
    # the --lora-paths start of a resumed LoRA job's servers: base + the checkpoint's adapter, at the
    # version given (0 here), served as peft serves it; a second adapter is refused
    from areal_async.embedded.lora import load_adapter

    policy = peft_policy(tiny_model_dir)
    path = write_adapter_dir(tmp_path / "ckpt", dict(adapter_items(policy)()), adapter_config(policy))
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            load_adapter(engine, "policy", path)
            assert_serves(await api.generate(prompt, **GREEDY), policy, prompt, 0)
            assert_holds(engine.adapter.tensors, policy)
            with pytest.raises(ValueError, match="already holds adapter 'policy'"):
                load_adapter(engine, "other", path)

    asyncio.run(main())
