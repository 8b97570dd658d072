"""Who can reach a job: every listening socket on loopback, the job's token on the servers and
the queue (HTTP 401 / ``Unauthorized`` without it, nothing changed), body limits (HTTP 413 /
``TooLarge``), and the token read as SGLang's ``--api-key`` reads it (``sglang_ref``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import msgspec
import pytest

from areal_async import auth, weight_group
from areal_async.config import InferenceConfig, ModelConfig, QueueConfig
from areal_async.inference.client import InferenceClient, ServerError
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.embedded.server import parse_args
from areal_async.queue import protocol as p
from areal_async.queue.client import QueueClient
from areal_async.queue.core import ReplayQueue
from areal_async.queue.server import serve as serve_queue
from launcher.local import _job_env
from launcher.servers import SERVER_ARGV
from tests.support.listening import listening, needs_proc, off_loopback
from areal_async.devices import free_port
from tests.support.sglang_ref import needs_sglang, run_sglang
from tests.support.weight_groups import host_group_in_thread, peer_group

TOKEN = "job-token-for-tests"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- every listening socket on loopback ------------------------------------------------------


@needs_proc
def test_weight_group_store_listens_on_loopback_only():
    port = free_port()
    trainer, joined, store = host_group_in_thread(port, "loopback")  # join as the server rank
    peer = peer_group(store, "loopback", 1)
    trainer.join(timeout=30)
    sockets = [s for s in listening(os.getpid()) if s[1] == port]
    weight_group.destroy_weight_group(joined["group"])
    assert peer.size() == 2
    assert sockets, f"nothing listens on the store's port {port}: the check would pass vacuously"
    # before: [('::', port)], every interface (torch's TCPStore binds the wildcard address)
    assert off_loopback(sockets) == [], sockets


PROBE = """
import json, os, sys
import torch.distributed as dist
from tests.support.listening import listening
dist.init_process_group("gloo")
dist.barrier()
out = {"agent": listening(os.getppid()), "rank": listening(os.getpid())}
dist.barrier()
json.dump(out, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


@needs_proc
def test_torchrun_rendezvous_and_gloo_listen_on_loopback_only(tmp_path):
    """The trainer as the launcher starts it (``launcher.torchrun``, the job's environment): the
    agent's rendezvous store and the rank's gloo sockets."""
    (tmp_path / "probe.py").write_text(PROBE)
    port = free_port()
    env = {**os.environ, **_job_env(TOKEN), "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "launcher.torchrun", "--nproc-per-node", "1", "--master-port", str(port),
                    str(tmp_path / "probe.py"), str(tmp_path / "out.json")], env=env, check=True, timeout=120,
                   capture_output=True)
    out = json.loads((tmp_path / "out.json").read_text())
    agent, rank = [tuple(s) for s in out["agent"]], [tuple(s) for s in out["rank"]]
    assert any(p == port for _, p in agent), f"the agent does not listen on --master-port {port}: {agent}"
    assert rank, "the rank has no gloo listener: the check would pass vacuously"
    # before: the agent listened on ('::', port)
    assert off_loopback(agent) == [] and off_loopback(rank) == [], (agent, rank)


# ---- the embedded server's token and body limit ----------------------------------------------


def _server(model_dir, token=TOKEN, max_request_bytes=1 << 20):
    engine, tokenizer = load_engine(str(model_dir), "float32", "cpu", 4, 128)
    return InferenceServer(engine, tokenizer, str(model_dir), token=token, max_request_bytes=max_request_bytes), engine


def test_server_endpoints_need_the_token_and_change_nothing_without_it(tiny_model_dir):
    async def body():
        server, engine = _server(tiny_model_dir)
        async with serve(server) as url, aiohttp.ClientSession() as http:
            async def status(method, path, headers=None, **kw):
                async with http.request(method, url + path, headers=headers or {}, **kw) as resp:
                    return resp.status

            assert await status("GET", "/health") == 200  # open, as on SGLang: probes need no secret
            assert await status("GET", "/ready") == 200
            wrong = auth.bearer_headers("not-the-token")
            for method, path, payload in [("POST", "/pause_generation", {"mode": "abort"}),
                                          ("POST", "/update_weights_from_disk",
                                           {"model_path": str(tiny_model_dir), "weight_version": "7"}),
                                          ("POST", "/abort_request", {"abort_all": True}),
                                          ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {}}),
                                          ("GET", "/get_weight_version", None)]:
                for headers in (None, wrong, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
                    assert await status(method, path, headers, json=payload) == 401, (path, headers)
            assert not engine._paused and engine.weight_version == 0  # nothing changed
            async with InferenceClient([url], token=TOKEN) as client:
                assert await client.get_weight_version(0) == 0
                out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0}, "r0")
                assert len(out.output_ids) == 2
                await client.pause()
                assert engine._paused
                await client.continue_generation()
            async with InferenceClient([url], token="not-the-token") as client:
                with pytest.raises(ServerError, match="HTTP 401"):
                    await client.get_weight_version(0)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_server_refuses_a_body_over_its_limit_and_keeps_serving(tiny_model_dir):
    async def body():
        server, _ = _server(tiny_model_dir, token=None, max_request_bytes=4096)
        async with serve(server) as url, aiohttp.ClientSession() as http:
            big = {"input_ids": [1] * 4096, "sampling_params": {"max_new_tokens": 1}}  # ~12 KB of JSON
            async with http.post(url + "/generate", json=big) as resp:
                assert resp.status == 413
            async with http.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params":
                                                            {"max_new_tokens": 1}}) as resp:
                assert resp.status == 200

    asyncio.run(asyncio.wait_for(body(), 120))


def test_server_needs_a_token_off_loopback(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(auth.ENV, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0"])
    assert parse_args(["--model-path", str(tiny_model_dir), "--host", "127.0.0.1", "--port", "0"]).api_key is None
    monkeypatch.setenv(auth.ENV, TOKEN)
    assert parse_args(["--model-path", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0"]).api_key == TOKEN


# ---- the queue's token and frame limit -------------------------------------------------------


def _queue():
    return ReplayQueue(QueueConfig(batch_size=2, max_staleness=0, max_concurrent=8), "deterministic")


def test_queue_needs_the_token_and_changes_nothing_without_it():
    async def body():
        queue = _queue()
        _, server = await serve_queue(queue, "127.0.0.1", 0, token=TOKEN)
        port = server.sockets[0].getsockname()[1]
        for token in (None, "not-the-token"):
            with pytest.raises(PermissionError, match="Unauthorized"):
                client = await QueueClient.connect("127.0.0.1", port, timeout_s=5, token=token)
                try:
                    await client.close()  # would close the queue
                finally:
                    await client.disconnect()
        # a raw frame without Auth first, straight to the queue's Close
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        p.write_frame(writer, msgspec.msgpack.encode(p.Close(rid=0)))
        reply = msgspec.msgpack.decode(await p.read_frame(reader), type=p.Reply)
        assert isinstance(reply, p.Error) and reply.kind == "Unauthorized" and reply.rid == p.CONNECTION
        assert await reader.read() == b""  # and the connection is closed
        writer.close()
        assert not (await queue.stats()).closed and (await queue.stats()).leased == 0  # nothing changed
        async with await QueueClient.connect("127.0.0.1", port, timeout_s=5, token=TOKEN) as client:
            assert await client.lease(0, 8) == [0, 1]
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_queue_refuses_a_frame_over_its_limit_and_keeps_serving():
    async def body():
        _, server = await serve_queue(_queue(), "127.0.0.1", 0, max_request_bytes=1024)
        port = server.sockets[0].getsockname()[1]
        client = await QueueClient.connect("127.0.0.1", port, timeout_s=5)
        with pytest.raises(ValueError, match="TooLarge"):
            await client.reject(0, "x" * 2048)
        await client.disconnect()
        async with await QueueClient.connect("127.0.0.1", port, timeout_s=5) as client:
            assert (await client.stats()).rejected == 0
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_queue_needs_a_token_off_loopback():
    async def body():
        with pytest.raises(ValueError, match="AREAL_ASYNC_TOKEN"):
            await serve_queue(_queue(), "0.0.0.0", 0)

    asyncio.run(body())


# ---- the launcher hands the token on -------------------------------------------------------


def test_launcher_gives_sglang_the_token_as_api_key_and_keeps_it_off_the_embedded_command_line():
    inf, model = InferenceConfig(), ModelConfig(path="/m")
    sglang = SERVER_ARGV["sglang"](inf, model, 31000, "throughput", 1, token=TOKEN)
    assert f"--api-key={TOKEN}" in sglang
    embedded = SERVER_ARGV["embedded"](inf, model, 31000, "throughput", 1, token=TOKEN)
    assert TOKEN not in embedded
    assert embedded[embedded.index("--max-request-bytes") + 1] == str(inf.max_request_bytes)
    assert _job_env(TOKEN)[auth.ENV] == TOKEN
    assert len(auth.new_token()) >= 43 and auth.new_token() != auth.new_token()


def test_job_env_puts_gloo_and_nccl_sockets_on_loopback_unless_set(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = _job_env(TOKEN)
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")  # the user's choice wins (multi-node)
    env = _job_env(TOKEN)
    assert "NCCL_SOCKET_IFNAME" not in env and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_token_that_starts_with_a_dash_reaches_sglang_whole(tiny_model_dir):
    # token_urlsafe draws "-" as the first character once in 64 launches; "--api-key -Xy..." made
    # argparse (SGLang's, and the embedded server's, which takes the same flags) stop with
    # "argument --api-key: expected one argument"
    from areal_async.embedded.server import parse_args

    token = "-" + TOKEN[1:]
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_dir), "--api-key", token])
    argv = SERVER_ARGV["sglang"](InferenceConfig(), ModelConfig(path="/m"), 31000, "throughput", 1, token=token)
    flags = [a for a in argv[3:] if a.startswith("--model-path") or a.startswith("--api-key")]
    assert flags == ["--model-path", f"--api-key={token}"]
    assert parse_args(["--model-path", str(tiny_model_dir), *flags[1:]]).api_key == token


# ---- SGLang reads the header as this project does ------------------------------------------

HEADERS = [None, "", f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer  {TOKEN}", f"Bearer {TOKEN} ",
           f"Bearer{TOKEN}", f"Basic {TOKEN}", TOKEN, "Bearer not-the-token", f"Bearer {TOKEN[:-1]}", "Bearer "]

SGLANG_DECIDES = """
import importlib.util, json, pathlib, sys
# sglang/srt/utils/auth.py imports only the standard library; loaded alone, without sglang's
# package imports (20 s of them)
path = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0], "srt", "utils", "auth.py")
spec = importlib.util.spec_from_file_location("sglang_srt_utils_auth", path)
sglang_auth = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(sglang_auth)
AuthLevel, decide_request_auth = sglang_auth.AuthLevel, sglang_auth.decide_request_auth
job = json.load(sys.stdin)
out = {}
for path, level in (("/update_weights_from_distributed", AuthLevel.ADMIN_OPTIONAL),
                    ("/pause_generation", AuthLevel.NORMAL), ("/health", AuthLevel.NORMAL),
                    ("/ready", AuthLevel.NORMAL)):
    out[path] = [decide_request_auth(method="POST", path=path, authorization_header=h, api_key=job["token"],
                                     admin_api_key=None, auth_level=level).allowed for h in job["headers"]]
print(json.dumps(out))
"""


@pytest.mark.sglang_ref
@needs_sglang
def test_sglang_with_api_key_accepts_exactly_the_headers_the_embedded_server_accepts():
    """SGLang 0.5.23's own decision (``--api-key`` = the token; the weight endpoints are its
    ``ADMIN_OPTIONAL`` level, which with only ``--api-key`` set requires it) against ours."""
    sglang = run_sglang(SGLANG_DECIDES, {"token": TOKEN, "headers": HEADERS})
    ours = [auth.bearer_ok(h, TOKEN) for h in HEADERS]
    assert ours[HEADERS.index(auth.bearer_headers(TOKEN)["Authorization"])]  # what our client sends passes
    assert sglang["/update_weights_from_distributed"] == ours
    assert sglang["/pause_generation"] == ours
    assert sglang["/health"] == sglang["/ready"] == [True] * len(HEADERS)  # open on both (auth.OPEN_PREFIXES)
