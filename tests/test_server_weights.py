"""The embedded server's weight updates over real HTTP: gloo broadcast and disk, weight groups,
version checks, unreadable weights, and SIGTERM while joining a group or receiving (a subprocess)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from areal_async import weight_group
from areal_async.devices import free_port
from tests.support.models import perturbed, prompt_ids, recompute_logprobs
from tests.support.servers import BUCKET, JOIN, running, server_logprobs
from tests.support.weight_groups import trainer_group


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_weight_update_over_gloo_changes_outputs_and_version(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    new = perturbed(tiny_model_dir, seed=1)
    names = [n for n, _ in new.named_parameters()]
    tensors = [p.detach().clone() for _, p in new.named_parameters()]
    port = free_port()
    kw = dict(max_new_tokens=12, temperature=1.0, sampling_seed=4, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        async with running(tiny_model_dir) as (api, _):
            before = await api.generate(prompt, **kw)
            # this test process is rank 0 (the trainer); the server joins as rank 1
            host = loop.run_in_executor(None, trainer_group, port)
            status, out = await api.post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": "weight_update_group"})
            assert status == 200 and out["success"], out
            group = await host
            send = loop.run_in_executor(None, weight_group.broadcast_, group, tensors)
            status, out = await api.post("/update_weights_from_distributed", {
                "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(t.shape) for t in tensors],
                "group_name": "weight_update_group", "flush_cache": True, "weight_version": "1"})
            await send
            assert status == 200 and out["success"], out
            version = await api.get("/get_weight_version")
            after = await api.generate(prompt, **kw)
            unknown = await api.post("/update_weights_from_distributed", {
                "names": ["model.nope"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": "2"})
            return before, after, version, unknown

    before, after, version, unknown = asyncio.run(main())
    assert version == (200, {"weight_version": "1"})
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    expected = recompute_logprobs(new, prompt, after["output_ids"], 1.0)
    assert torch.allclose(server_logprobs(after), expected, atol=1e-5, rtol=0)
    assert unknown[0] == 400 and "unknown weight name 'model.nope'" in unknown[1]["message"]


def test_weight_update_from_disk(tiny_model_dir, tmp_path):
    prompt = prompt_ids(tiny_model_dir)
    new = perturbed(tiny_model_dir, seed=2)
    new.save_pretrained(tmp_path / "step2")
    kw = dict(max_new_tokens=12, temperature=1.0, sampling_seed=4, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, _):
            before = await api.generate(prompt, **kw)
            ok = await api.post("/update_weights_from_disk", {"model_path": str(tmp_path / "step2"), "weight_version": "2"})
            missing = await api.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nothing")})
            info = await api.get("/get_model_info")
            return before, await api.generate(prompt, **kw), ok, missing, info

    before, after, ok, missing, info = asyncio.run(main())
    assert ok[0] == 200 and ok[1]["success"] and ok[1]["num_paused_requests"] == 0
    assert missing[0] == 400 and not missing[1]["success"] and "no *.safetensors" in missing[1]["message"]
    assert info[1]["weight_version"] == "2" and info[1]["is_generation"] is True
    assert after["output_ids"] != before["output_ids"]
    expected = recompute_logprobs(new, prompt, after["output_ids"], 1.0)
    assert torch.allclose(server_logprobs(after), expected, atol=1e-5, rtol=0)


def test_weight_group_rank_zero_is_refused(tiny_model_dir):
    # rank 0 is the trainer (the broadcast source); a server there would load its own empty buffers
    async def main():
        async with running(tiny_model_dir) as (api, _):
            return await api.post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 1,
                "backend": "gloo", "group_name": "g"})

    status, out = asyncio.run(main())
    assert status == 400 and not out["success"] and "rank_offset must be >= 1" in out["message"]


def test_unknown_weight_group_backend_fails_before_waiting_for_peers():
    import time

    from areal_async.weight_group import new_weight_group

    start = time.perf_counter()
    with pytest.raises(ValueError, match="backend 'foo' is not supported"):
        new_weight_group("foo", "127.0.0.1", 1, 1, 2, timeout_s=30.0)  # nobody listens on port 1
    assert time.perf_counter() - start < 5.0


def test_weight_update_with_a_bad_version_is_refused_and_changes_nothing(tiny_model_dir, tmp_path):
    prompt = prompt_ids(tiny_model_dir)
    perturbed(tiny_model_dir, seed=3).save_pretrained(tmp_path / "new")
    kw = dict(max_new_tokens=8, temperature=1.0, sampling_seed=4, ignore_eos=True)
    bad_versions = [-1, "-1", "1.5", 1.5, "default", True, [1], ""]

    async def main():
        async with running(tiny_model_dir) as (api, _):
            before = await api.generate(prompt, **kw)
            refused = []
            for version in bad_versions:
                refused.append(await api.post("/update_weights_from_disk", {
                    "model_path": str(tmp_path / "new"), "weight_version": version, "abort_all_requests": True}))
                refused.append(await api.post("/update_weights_from_distributed", {
                    "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "weight_version": version}))
            return before, refused, await api.get("/get_weight_version"), await api.generate(prompt, **kw)

    before, refused, version, after = asyncio.run(main())
    for (status, out), bad in zip(refused, [v for v in bad_versions for _ in range(2)]):
        assert status == 400 and not out["success"], (bad, out)
        assert f"weight_version {bad!r} is not a non-negative integer" in out["message"], out
        assert 'e.g. "3"' in out["message"]
    assert version == (200, {"weight_version": "0"})
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "0"


def _server_process(model_dir) -> tuple[subprocess.Popen, str]:
    """``python -m areal_async.embedded.server`` on the tiny model (CPU), and its URL once serving."""
    cmd = [sys.executable, "-m", "areal_async.embedded.server", "--model-path", str(model_dir), "--port", "0",
           "--dtype", "float32", "--device", "cpu", "--max-running-requests", "2", "--max-seq-len", "64",
           "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [proc.stdout.readline()]
    while lines[-1] and "inference server on " not in lines[-1]:  # past any load-time warnings
        lines.append(proc.stdout.readline())
    if not lines[-1]:
        proc.kill()
        raise AssertionError("".join(lines))
    return proc, lines[-1].split("inference server on ")[1].split()[0]


def _post_in_thread(url: str, path: str, payload: dict, replies: dict) -> threading.Thread:
    """POST ``payload`` to ``url + path`` from a daemon thread; ``replies[path]`` gets (status, body)."""

    def post():
        request = urllib.request.Request(url + path, json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                replies[path] = (resp.status, resp.read())
        except urllib.error.HTTPError as exc:
            replies[path] = (exc.code, exc.read())
        except OSError as exc:
            replies[path] = (None, repr(exc))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def _stops_on_sigterm(proc: subprocess.Popen, what: str) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server ignored SIGTERM for 10 s while {what}")
    assert code == 0, proc.stdout.read()


def test_sigterm_stops_a_server_waiting_for_weight_group_peers(tiny_model_dir):
    # a peer that accepts the store connection and never answers: the server's join blocks there
    silent_peer = socket.create_server(("127.0.0.1", 0))
    silent_peer.settimeout(60)
    replies: dict[str, tuple] = {}
    proc, url = _server_process(tiny_model_dir)
    try:
        joiner = _post_in_thread(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": silent_peer.getsockname()[1], "rank_offset": 1,
            "world_size": 2, "backend": "gloo"}, replies)
        connection, _ = silent_peer.accept()  # the server is inside the blocking join now
        _stops_on_sigterm(proc, "joining a weight group")
        joiner.join(timeout=10)
        connection.close()
    finally:
        silent_peer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, reply = replies.get("/init_weights_update_group", (None, b""))
    assert status == 503 and b"shutting down" in reply, replies


def test_sigterm_stops_a_server_blocked_receiving_a_weight_broadcast(tiny_model_dir):
    # The server has joined a gloo weight group with this process (rank 0, the trainer) and is
    # inside /update_weights_from_distributed, waiting for a broadcast that never comes (a trainer
    # that gave up on this version): SIGTERM must still stop it promptly.
    from areal_async import weight_group

    replies: dict[str, tuple] = {}
    proc, url = _server_process(tiny_model_dir)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        joiner = _post_in_thread(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}, replies)
        group = weight_group.new_weight_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=60)
        joiner.join(timeout=30)
        assert replies["/init_weights_update_group"][0] == 200, replies
        updater = _post_in_thread(url, "/update_weights_from_distributed", {
            "names": ["model.norm.weight", "model.layers.0.input_layernorm.weight"], "dtypes": ["float32"] * 2,
            "shapes": [[64], [64]], "weight_version": "1"}, replies)
        # The first of the bucket's two tensors: gloo's broadcast returns at the root only once the
        # receiver has posted its receive, so the server is inside the receive when this returns
        # (bounded by the group's 60 s timeout); the second broadcast never comes.
        weight_group.broadcast_(group, [torch.ones(64)], src=0)
        _stops_on_sigterm(proc, "receiving a weight broadcast")
        updater.join(timeout=10)
        weight_group.destroy_weight_group(group)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, reply = replies.get("/update_weights_from_distributed", (None, b""))
    assert status == 503 and b"shutting down" in reply, replies


def test_unreadable_weights_and_non_json_bodies_get_json_400s(tiny_model_dir, tmp_path):
    # a truncated/corrupt safetensors file, or one with only some of the weights, is bad input (400
    # with the error shape), not a server error, and the weights in service stay as they were
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")

    async def main():
        async with running(tiny_model_dir, slots=2, max_seq_len=64) as (api, engine):
            corrupt = await api.post("/update_weights_from_disk", {"model_path": str(bad), "weight_version": "1"})
            missing = await api.post("/update_weights_from_disk", {"weight_version": "1"})
            partial_dir = tmp_path / "partial"
            partial_dir.mkdir()
            save_file({"model.norm.weight": torch.zeros(64)}, str(partial_dir / "model.safetensors"))
            partial = await api.post("/update_weights_from_disk", {"model_path": str(partial_dir),
                                                                   "weight_version": "1"})
            async with api.http.post(api.url + "/generate", data=b"{not json",
                                     headers={"Content-Type": "application/json"}) as resp:
                not_json = resp.status, await resp.json()
            return corrupt, missing, partial, not_json, engine.weight_version

    corrupt, missing, partial, not_json, version = asyncio.run(main())
    assert partial[0] == 400 and "holds 1 of the model's" in partial[1]["message"], partial
    assert corrupt[0] == 400 and "not a readable safetensors file" in corrupt[1]["message"], corrupt
    assert missing[0] == 400 and "model_path None" in missing[1]["message"], missing
    assert not_json[0] == 400 and "not JSON" in not_json[1]["error"]["message"], not_json
    assert version == 0


def test_weight_update_behind_the_current_version_or_past_int64_is_refused_before_reading(tiny_model_dir, tmp_path):
    # refused versions point at other weights: the answer and the generation show nothing was loaded;
    # the distributed call has no weight group, so its version is checked before anything else
    prompt = prompt_ids(tiny_model_dir)
    perturbed(tiny_model_dir, seed=5).save_pretrained(tmp_path / "other")
    kw = dict(max_new_tokens=8, temperature=1.0, sampling_seed=4, ignore_eos=True)
    refused_versions = ["4", 4, "0", str(2**63), 2**63, "9" * 40]

    async def main():
        async with running(tiny_model_dir) as (api, _):
            set_to_5 = await api.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                    "weight_version": "5"})
            before = await api.generate(prompt, **kw)
            refused = []
            for version in refused_versions:
                refused.append(await api.post("/update_weights_from_disk", {
                    "model_path": str(tmp_path / "other"), "weight_version": version}))
                refused.append(await api.post("/update_weights_from_distributed", {
                    "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                    "weight_version": version}))
            after = await api.generate(prompt, **kw)
            again = await api.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                 "weight_version": "5"})
            return set_to_5, before, refused, after, again

    set_to_5, before, refused, after, again = asyncio.run(main())
    assert set_to_5[0] == 200, set_to_5
    for (status, out), sent in zip(refused, [v for v in refused_versions for _ in range(2)]):
        assert status == 400 and not out["success"], (sent, out)
        if int(sent) < 5:
            assert f"weight_version {sent!r} is behind this server's current version 5" in out["message"], out
        else:
            assert f"weight_version {sent!r} is not below 2**63" in out["message"], out
            assert "this server is at version 5" in out["message"], out
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "5"
    # the same version again is accepted: every bucket of a distributed update carries it
    assert again[0] == 200 and again[1]["success"], again


def test_a_bucket_behind_the_server_version_fails_the_trainer_side_at_once(tiny_model_dir):
    # The trainer's side of a refused bucket (weight_sync._with_server_calls): the server answers
    # 400 without entering the broadcast, so the sender raises at once instead of waiting in the
    # broadcast for the group's timeout; the group is left in step (a later accepted bucket
    # receives the broadcast the trainer still has pending).
    from areal_async.inference.client import InferenceClient
    from areal_async.trainer.weight_sync import _with_server_calls

    port = free_port()
    halves = torch.full((64,), 0.5)  # not the norm weight it replaces (ones)
    sent = threading.Event()

    def broadcast(group):
        weight_group.broadcast_(group, [halves])
        sent.set()

    async def main():
        loop = asyncio.get_running_loop()
        async with running(tiny_model_dir) as (api, engine), InferenceClient([api.url]) as client:
            await client.update_weights_from_disk(0, str(tiny_model_dir), 2)
            host = loop.run_in_executor(None, trainer_group, port)
            await client.init_weights_update_group(0, "127.0.0.1", port, 1, 2, "gloo")
            group = await host
            bucket = (["model.norm.weight"], ["float32"], [[64]])
            call = asyncio.gather(client.update_weights_from_distributed(0, *bucket, 1))
            start = time.perf_counter()
            with pytest.raises(RuntimeError, match="refused: .* HTTP 400: .*weight_version '1' is behind this "
                                                   "server's current version 2"):
                await _with_server_calls(weight_group.in_daemon_thread(broadcast, group), call, "refused")
            waited_s = time.perf_counter() - start
            accepted = await client.update_weights_from_distributed(0, *bucket, 2)
            released = await asyncio.to_thread(sent.wait, 30)
            return waited_s, accepted, released, engine.weight_version, engine.forward.model.model.norm.weight

    waited_s, accepted, released, version, norm = asyncio.run(main())
    assert waited_s < 5, f"the trainer side waited {waited_s:.1f} s for a refused bucket"
    assert accepted["success"] and released and version == 2
    assert torch.equal(norm, halves)


async def _join_group(api, port: int, name: str):
    """The server joins a 2-rank weight group ``name`` that a thread hosts as the trainer on
    ``port``; returns the join's answer."""
    host = asyncio.get_running_loop().run_in_executor(None, trainer_group, port, 2, name)
    joined = await api.post("/init_weights_update_group", {**JOIN, "master_port": port, "world_size": 2,
                                                           "group_name": name})
    await host
    return joined


def test_a_weight_update_without_group_name_names_the_default_and_the_joined_groups(tiny_model_dir):
    port = free_port()

    async def main():
        async with running(tiny_model_dir) as (api, _):
            joined = await _join_group(api, port, "g")
            return joined, await api.post("/update_weights_from_distributed", BUCKET)

    joined, (status, out) = asyncio.run(main())
    assert joined[0] == 200, joined
    assert status == 400 and "no weight group 'weight_update_group' (joined: 'g')" in out["message"], out
    assert "call /init_weights_update_group with group_name 'weight_update_group' first" in out["message"]


def test_destroy_weights_update_group_answers_as_sglang_and_frees_the_name(tiny_model_dir):
    # SGLang 0.5.23: 200 {success: true} for a held group; 400 {success: false, "The group to be
    # destroyed does not exist."} for another name or a second time; the destroyed name can be joined
    # again and an update naming it afterwards finds no group
    port, again = free_port(), free_port()

    async def main():
        async with running(tiny_model_dir) as (api, _):
            joined = await _join_group(api, port, "g")
            answers = [await api.post("/destroy_weights_update_group", {"group_name": name}) for name in ("h", "g", "g")]
            unknown = await api.post("/update_weights_from_distributed", {**BUCKET, "group_name": "g"})
            rejoined = await _join_group(api, again, "g")
            default = await api.post("/destroy_weights_update_group", {})
            return joined, answers, unknown, rejoined, default

    joined, (other, first, second), unknown, rejoined, default = asyncio.run(main())
    assert joined[0] == rejoined[0] == 200, (joined, rejoined)
    assert first == (200, {"success": True, "message": "destroyed weight group 'g'"})
    for answer in (other, second, default):  # default: SGLang's group_name, "weight_update_group", never joined
        assert answer == (400, {"success": False, "message": "The group to be destroyed does not exist."})
    assert unknown[0] == 400 and "no weight group 'g' (joined: none yet)" in unknown[1]["message"], unknown
