"""The embedded inference server over real HTTP: generation, log-probs, seeds, batching, flow
control and weight updates (gloo broadcast and disk), with the tiny fp32 Llama / Qwen3 models;
input checks (rid shapes, stop ids, weight versions), a client that disconnects mid-generation, and
SIGTERM while a weight-group join waits for peers (a subprocess)."""

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

import aiohttp
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_async import weight_group
from areal_async.inference.routing import engine_failure
from tests.support.models import perturbed, prompt_ids, recompute_logprobs
from areal_async.devices import free_port
from tests.support.servers import running, server_logprobs
from tests.support.weight_groups import trainer_group


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_shapes_and_logprobs_match_trainer_recompute(arch, tiny_model_dir, tiny_qwen3_dir):
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen3_dir
    prompt = prompt_ids(model_dir)

    async def main():
        async with running(model_dir) as (api, _):
            full = await api.generate(prompt, "r1", max_new_tokens=24, temperature=0.8, sampling_seed=3, ignore_eos=True)
            # stop at the first occurrence of the 4th token: same seed ⇒ same prefix, then "stop"
            # (without ignore_eos, which turns stop_token_ids off as well on SGLang)
            stop_at = full["output_ids"].index(full["output_ids"][3])
            stopped = await api.generate(prompt, max_new_tokens=24, temperature=0.8, sampling_seed=3,
                                         stop_token_ids=[full["output_ids"][3]])
            return full, stop_at, stopped

    full, stop_at, stopped = asyncio.run(main())
    meta = full["meta_info"]
    assert set(full) == {"text", "output_ids", "meta_info"} and isinstance(full["text"], str)
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24 == len(full["output_ids"])
    assert meta["weight_version"] == "0" and meta["cached_tokens"] == 0
    assert [e[1] for e in meta["output_token_logprobs"]] == full["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = recompute_logprobs(model, prompt, full["output_ids"], 0.8)
    assert torch.allclose(server_logprobs(full), expected, atol=1e-5, rtol=0), (server_logprobs(full) - expected).abs().max()
    assert stopped["output_ids"] == full["output_ids"][: stop_at + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": full["output_ids"][3]}


def test_seeds_reproduce_and_differ(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)

    async def main():
        async with running(tiny_model_dir) as (api, _):
            kw = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
            a = await api.generate(prompt, sampling_seed=11, **kw)
            b = await api.generate(prompt, sampling_seed=11, **kw)
            c = await api.generate(prompt, sampling_seed=12, **kw)
            return a["output_ids"], b["output_ids"], c["output_ids"]

    a, b, c = asyncio.run(main())
    assert a == b
    assert a != c


def test_request_alone_equals_request_batched_with_others(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    others = [prompt_ids(tiny_model_dir, f"Question number {i} about {'eggs ' * i}?") for i in range(1, 6)]
    kw = dict(temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            alone = await api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw)
            together = await asyncio.gather(
                api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw),
                *(api.generate(p, max_new_tokens=4 + 3 * i, sampling_seed=i, **kw) for i, p in enumerate(others)),
            )
            # join mid-flight: others are decoding (and finishing, so slots get compacted) when it arrives
            early = [asyncio.create_task(api.generate(p, max_new_tokens=2 + 2 * i, sampling_seed=i, **kw))
                     for i, p in enumerate(others)]
            await engine.next_step()
            late = await api.generate(prompt, max_new_tokens=20, sampling_seed=5, **kw)
            await asyncio.gather(*early)
            return alone, together[0], late

    alone, together, late = asyncio.run(main())
    assert together["output_ids"] == alone["output_ids"]
    assert late["output_ids"] == alone["output_ids"]
    assert torch.allclose(server_logprobs(together), server_logprobs(alone), atol=1e-5)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [], "sampling_params": {"max_new_tokens": 4}}, "input_ids is empty"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens -1 is negative"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens '8' has the wrong JSON type"),
        ({"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 5}}, "exceeds the server's max_seq_len 64"),
        ({"input_ids": [1, 10**6], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "unknown sampling_params field 'temprature'"),
        ({"sampling_params": {}}, "send 'input_ids'"),
        ({"input_ids": [[1, 2], 3]}, "list of integer token ids"),
        ({"input_ids": [1, True]}, "list of integer token ids"),
        ({"input_ids": [1, 2], "sampling_params": [1]}, "must be a JSON object"),
    ],
)
def test_bad_input_is_400_with_a_message(tiny_model_dir, body, message):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            return await api.post("/generate", body)

    status, out = asyncio.run(main())
    assert status == 400
    assert message in out["error"]["message"]


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(max_new_tokens=200, temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            tasks = [asyncio.create_task(api.generate(prompt, sampling_seed=i, **kw)) for i in range(2)]
            for _ in range(3):
                await engine.next_step()
            assert (await api.get("/ready"))[0] == 200
            status, _ = await api.post("/pause_generation", {"mode": "abort"})
            assert status == 200
            assert (await api.get("/ready"))[0] == 503  # SGLang's: paused
            aborted = await asyncio.gather(*tasks)
            held = asyncio.create_task(api.generate(prompt, sampling_seed=9, max_new_tokens=5))
            while not engine._waiting:  # the held request reached the engine's queue
                await asyncio.sleep(0.005)
            assert not held.done() and engine.num_running == 0
            status, _ = await api.post("/continue_generation", {})
            assert status == 200
            assert (await api.get("/ready"))[0] == 200
            return aborted, await held

    aborted, held = asyncio.run(main())
    for resp in aborted:
        assert resp["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= len(resp["output_ids"]) < 200
        assert len(resp["meta_info"]["output_token_logprobs"]) == len(resp["output_ids"])
    assert held["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_abort_request_by_rid_and_all(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            a = asyncio.create_task(api.generate(prompt, "a", max_new_tokens=200, sampling_seed=1, **kw))
            b = asyncio.create_task(api.generate(prompt, "b", max_new_tokens=30, sampling_seed=2, **kw))
            await engine.next_step()
            status, out = await api.post("/abort_request", {"rid": "a"})
            assert status == 200
            first = await asyncio.gather(a, b)
            c = asyncio.create_task(api.generate(prompt, "c", max_new_tokens=200, sampling_seed=3, **kw))
            await engine.next_step()
            await api.post("/abort_request", {"abort_all": True})
            bad = await api.post("/abort_request", {})
            return first, await c, bad

    (a, b), c, bad = asyncio.run(main())
    assert a["meta_info"]["finish_reason"]["type"] == "abort" and 1 <= len(a["output_ids"]) < 200
    assert b["meta_info"]["finish_reason"]["type"] == "length" and len(b["output_ids"]) == 30
    assert c["meta_info"]["finish_reason"]["type"] == "abort"
    assert bad[0] == 400


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


def test_health_and_flush(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir) as (api, _):
            return [await api.get("/health"), await api.get("/health_generate"),
                    await api.post("/flush_cache"), await api.get("/get_model_info")]

    health, health_gen, flush, info = asyncio.run(main())
    assert health[0] == health_gen[0] == flush[0] == 200
    assert info[1]["model_path"] == str(tiny_model_dir)


def test_weight_group_rank_zero_is_refused(tiny_model_dir):
    # rank 0 is the trainer (the broadcast source); a server there would load its own empty buffers
    async def main():
        async with running(tiny_model_dir) as (api, _):
            return await api.post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 1,
                "backend": "gloo", "group_name": "g"})

    status, out = asyncio.run(main())
    assert status == 400 and not out["success"] and "rank_offset must be >= 1" in out["message"]


@pytest.mark.parametrize("flags, words", [
    (["--max-running-requests", "0"], "--max-running-requests 0: must be >= 1"),
    (["--max-seq-len", "0"], "--max-seq-len 0: must be >= 1"),
    (["--prefix-cache-entries", "0"], "--prefix-cache-entries 0: must be >= 1"),
    (["--max-queued-requests", "0"], "--max-queued-requests 0: must be >= 1"),
    (["--port", "99999"], "--port 99999: must be in [0, 65535]"),
    (["--device", "gpu"], "--device='gpu' is not a device"),
    (["--weight-version", "-3"], "--weight-version -3: must be >= 0"),
    (["--weight-version", str(2**63)], f"--weight-version {2**63}: must be >= 0 and < 2**63"),
])
def test_server_rejects_bad_arguments_before_loading(tiny_model_dir, capsys, flags, words):
    from areal_async.embedded.server import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-path", str(tiny_model_dir), "--port", "0", *flags])  # the last --port wins
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_server_rejects_a_port_in_use_before_loading(tiny_model_dir, capsys):
    from areal_async.embedded.server import parse_args

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--model-path", str(tiny_model_dir), "--port", str(port)])
    assert exit_info.value.code == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_server_rejects_a_model_path_without_a_model(tmp_path, capsys):
    from areal_async.embedded.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path / "nowhere"), "--port", "0"])  # not the default 30000, which may be in use
    assert "not an HF model directory" in capsys.readouterr().err


def test_unknown_weight_group_backend_fails_before_waiting_for_peers():
    import time

    from areal_async.weight_group import new_weight_group

    start = time.perf_counter()
    with pytest.raises(ValueError, match="backend 'foo' is not supported"):
        new_weight_group("foo", "127.0.0.1", 1, 1, 2, timeout_s=30.0)  # nobody listens on port 1
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "ids, rid, message",
    [
        ([1, 2], 7, "rid 7 is not a non-empty string"),
        ([1, 2], ["a"], "rid ['a'] is not a non-empty string"),
        ([1, 2], "", "rid '' is not a non-empty string"),
        ([[1, 2], [3]], "a", "rid 'a' is not a list of 2 non-empty strings"),
        ([[1, 2], [3]], ["a", 2], "rid ['a', 2] is not a list of 2 non-empty strings"),
        ([[1, 2], [3]], ["a"], "rid ['a'] is not a list of 2 non-empty strings"),
        ([[1, 2], [3], [4]], ["a", "b", "a"], "rid 'a' is given to 2 prompts of the batch"),
    ],
)
def test_generate_rejects_a_rid_of_the_wrong_shape(tiny_model_dir, ids, rid, message):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, engine):
            bad = await api.post("/generate", {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 2}})
            return bad, engine.num_running

    (status, out), running_after = asyncio.run(main())
    assert status == 400, out
    assert message in out["error"]["message"] and "(or leave rid out)" in out["error"]["message"]
    assert running_after == 0


def test_generate_accepts_sglang_rid_shapes(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            one = await api.post("/generate", {"input_ids": [1, 2], "rid": "x", "sampling_params": {"max_new_tokens": 2}})
            two = await api.post("/generate", {"input_ids": [[1, 2], [3]], "rid": ["p", "q"],
                                               "sampling_params": {"max_new_tokens": 2}})
            anon = await api.post("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}})
            return one, two, anon

    one, two, anon = asyncio.run(main())
    assert one[0] == two[0] == anon[0] == 200
    assert one[1]["meta_info"]["id"] == "x"
    assert [r["meta_info"]["id"] for r in two[1]] == ["p", "q"]
    assert len({r["meta_info"]["id"] for r in anon[1]}) == 2


@pytest.mark.parametrize("bad", [-1, "vocab_size", 10**6])
def test_generate_rejects_stop_token_ids_outside_the_vocabulary(tiny_model_dir, bad):
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    bad = vocab_size if bad == "vocab_size" else bad

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            sampling = {"stop_token_ids": [3, bad], "max_new_tokens": 4}
            return await api.post("/generate", {"input_ids": [1, 2], "sampling_params": sampling})

    status, out = asyncio.run(main())
    assert status == 400, out
    assert f"stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})" in out["error"]["message"]


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


def test_a_disconnected_client_frees_its_slot(tiny_model_dir):
    prompt = prompt_ids(tiny_model_dir)
    max_new_tokens = 1500

    async def main():
        async with running(tiny_model_dir, max_seq_len=2048) as (api, engine):
            async with aiohttp.ClientSession() as gone:
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
                request = asyncio.create_task(gone.post(api.url + "/generate", json=body))
                await asyncio.wait_for(engine.next_step(), 60)  # the engine's first step: its prefill
                assert engine.num_running == 1  # admitted: it holds a slot
                request.cancel()  # drops the connection
            steps = 0
            while engine.num_running and steps < 200:
                await engine.next_step()
                steps += 1
            # the server still serves
            return steps, await api.generate(prompt, max_new_tokens=2)

    steps, after = asyncio.run(main())
    # aborted within a few steps of the disconnect (the connection loss reaches the handler at once),
    # not after the 1500 tokens it asked for
    assert steps < 50, f"the request ran {steps} more steps after its client went away"
    assert len(after["output_ids"]) <= 2


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


def test_raised_and_returned_bad_input_answers_have_the_same_shape(tiny_model_dir):
    # a body that is not JSON is refused where the handler raises (_body); both input_ids and text
    # where it returns: both are SGLang's {"error": {"message": ...}} with a JSON content type
    async def main():
        async with running(tiny_model_dir, slots=2, max_seq_len=64) as (api, _):
            answers = []
            for data in (b"{not json", json.dumps({"input_ids": [1, 2], "text": "a"}).encode()):
                async with api.http.post(api.url + "/generate", data=data,
                                         headers={"Content-Type": "application/json"}) as resp:
                    answers.append((resp.status, resp.content_type, resp.charset, json.loads(await resp.text())))
            return answers

    raised, returned = asyncio.run(main())
    for status, content_type, charset, body in (raised, returned):
        assert (status, content_type, charset) == (400, "application/json", "utf-8")
        assert list(body) == ["error"] and list(body["error"]) == ["message"], body
    assert "not JSON" in raised[3]["error"]["message"]
    assert "send either 'input_ids' or 'text', not both" in returned[3]["error"]["message"]


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


def test_a_rid_held_by_an_unfinished_request_is_refused(tiny_model_dir):
    # /abort_request by rid would stop both requests; the one holding the rid runs on untouched
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            busy = asyncio.create_task(api.generate(prompt, "busy", sampling_seed=1, **kw))
            while engine.num_running == 0:  # admitted: it holds a slot
                await asyncio.sleep(0.005)
            await api.post("/pause_generation", {"mode": "in_place"})  # it stays unfinished meanwhile
            async with asyncio.timeout(30):  # an accepted request would wait for the pause to end
                again = await api.post("/generate", {"input_ids": prompt, "rid": "busy", "sampling_params": kw})
                in_batch = await api.post("/generate", {"input_ids": [prompt, prompt], "rid": ["other", "busy"],
                                                        "sampling_params": kw})
            left = len(engine._unfinished())
            await api.post("/continue_generation", {})
            done = await busy
            reused = await api.generate(prompt, "busy", sampling_seed=1, **kw)  # finished: its rid is free
            return done, again, in_batch, left, reused

    busy, again, in_batch, left, reused = asyncio.run(main())
    for status, out in (again, in_batch):
        assert status == 400, out
        assert "rid 'busy' is already running in another request" in out["error"]["message"], out
    assert left == 1, "a refused batch left a request queued"
    assert busy["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert reused["output_ids"] == busy["output_ids"]


def test_a_rid_taken_between_the_check_and_the_queueing_is_refused(tiny_model_dir):
    # The handler checks the rid, then its request is queued by a task that runs later; a rival
    # queued in between (here: scheduled by the check itself) holds the rid first. The engine
    # refuses the second as it queues it, and the handler answers 400, as for the check.
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, engine):
            checked, rivals = engine.validate, []

            def validate(input_ids, params, rid=None):
                checked(input_ids, params, rid)
                if rid == "raced" and not rivals:
                    rivals.append(asyncio.ensure_future(engine.generate(input_ids, params, rid)))

            engine.validate = validate
            answer = await api.post("/generate", {"input_ids": [1, 2], "rid": "raced",
                                                  "sampling_params": {"max_new_tokens": 2}})
            return answer, len(rivals) and (await rivals[0]).finish_reason

    (status, out), rival = asyncio.run(main())
    assert status == 400, out
    assert "rid 'raced' is already running in another request" in out["error"]["message"], out
    assert rival == "length"


def test_non_finite_logprobs_are_a_json_500_naming_the_weight_version(tiny_model_dir, tmp_path):
    # weights with a NaN norm make every logit NaN: JSON has no NaN (the old answer was a 200 with
    # bare NaN in it), and the rollout worker must fail on them rather than train on noise
    from areal_async.inference.client import InferenceClient, ServerError

    nan_weights(tiny_model_dir, tmp_path / "nan")

    def no_constants(name):
        raise ValueError(f"{name} in a JSON answer")

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            loaded = await api.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nan"),
                                                                  "weight_version": "3"})
            answers = []
            for ids, rid, logprob in (([1, 2], "one", True), ([[1, 2], [3]], ["p", "q"], True), ([1, 2], "bare", False)):
                body = {"input_ids": ids, "rid": rid, "return_logprob": logprob, "sampling_params": {"max_new_tokens": 3}}
                async with api.http.post(api.url + "/generate", json=body) as resp:
                    answers.append((resp.status, resp.content_type, json.loads(await resp.text(),
                                                                               parse_constant=no_constants)))
            async with InferenceClient([api.url]) as client:
                with pytest.raises(ServerError, match="HTTP 500: .*non-finite log-probs .* under weight version 3"):
                    await client.generate([1, 2], {"max_new_tokens": 3}, "worker-sample")
            health = [await health_generate(api)]
            fixed = await api.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                                 "weight_version": "4"})
            health.append(await health_generate(api))
            return loaded, answers, fixed, health, await api.generate([1, 2], max_new_tokens=3, ignore_eos=True)

    async def health_generate(api):
        async with api.http.get(api.url + "/health_generate") as resp:
            return resp.status, await resp.text()

    loaded, answers, fixed, health, after = asyncio.run(main())
    assert loaded[0] == 200 and fixed[0] == 200
    assert health[0][0] == 503 and "under weight version 3" in health[0][1], health  # as SGLang's failed check
    assert health[1] == (200, ""), health
    for (status, content_type, body), rid, more in zip(answers, ["one", "p", "bare"], ["", " (and 1 more", ""]):
        assert (status, content_type) == (500, "application/json"), body
        message = body["error"]["message"]
        assert f"non-finite log-probs (NaN or inf) for rid {rid!r}{more}" in message, message
        assert "under weight version 3" in message, message
    assert after["meta_info"]["weight_version"] == "4" and len(after["output_ids"]) == 3


_JOIN = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 1, "backend": "gloo"}


async def _join_group(api, port: int, name: str):
    """The server joins a 2-rank weight group ``name`` that a thread hosts as the trainer on
    ``port``; returns the join's answer."""
    host = asyncio.get_running_loop().run_in_executor(None, trainer_group, port, 2, name)
    joined = await api.post("/init_weights_update_group", {**_JOIN, "master_port": port, "world_size": 2,
                                                           "group_name": name})
    await host
    return joined


_BUCKET = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
_SHORT = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}  # runs, were its other fields right


@pytest.mark.parametrize("path, body, words", [
    ("/generate", {"text": [1, 2]}, "text [1, 2] is not a string, or a non-empty list of strings"),
    ("/generate", {"text": ["a", 5]}, "text ['a', 5] is not a string"),
    ("/generate", {"text": 5}, "text 5 is not a string"),
    ("/generate", {"text": []}, "text [] is not a string"),
    ("/generate", {**_SHORT, "text": "2 + 2 ="}, "send either 'input_ids' or 'text', not both"),
    ("/generate", {**_SHORT, "return_logprob": "false"}, "return_logprob 'false' is not a JSON boolean"),
    ("/generate", {**_SHORT, "return_logprob": 1}, "return_logprob 1 is not a JSON boolean"),
    ("/generate", {**_SHORT, "stream": "false"}, "stream 'false' is not a JSON boolean"),
    ("/init_weights_update_group", {**_JOIN, "rank_offset": None}, "rank_offset None is not an integer"),
    ("/init_weights_update_group", {**_JOIN, "rank_offset": [1]}, "rank_offset [1] is not an integer"),
    ("/init_weights_update_group", {**_JOIN, "rank_offset": 1.5}, "rank_offset 1.5 is not an integer"),
    ("/init_weights_update_group", {**_JOIN, "rank_offset": True}, "rank_offset True is not an integer"),
    ("/init_weights_update_group", {k: v for k, v in _JOIN.items() if k != "rank_offset"}, "rank_offset is missing"),
    ("/init_weights_update_group", {**_JOIN, "master_port": "x"}, "master_port 'x' is not a port number"),
    ("/init_weights_update_group", {**_JOIN, "master_port": 70000}, "master_port 70000 is not a port number"),
    ("/init_weights_update_group", {**_JOIN, "world_size": "1.5"}, "world_size '1.5' is not an integer"),
    ("/init_weights_update_group", {**_JOIN, "backend": 5}, "backend 5 is not a non-empty string"),
    ("/init_weights_update_group", {**_JOIN, "group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/init_weights_update_group", {**_JOIN, "master_address": [1]}, "master_address [1] is not a non-empty string"),
    ("/update_weights_from_distributed", {**_BUCKET, "names": 5}, "names 5 is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**_BUCKET, "names": [5]}, "names [5] is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**_BUCKET, "dtypes": [5]}, "dtypes [5] is not a list of non-empty strings"),
    ("/update_weights_from_distributed", {**_BUCKET, "shapes": [64]}, "shapes [64] is not a list of shapes"),
    ("/update_weights_from_distributed", {**_BUCKET, "shapes": [[64.5]]}, "shapes [[64.5]] is not a list of shapes"),
    ("/update_weights_from_distributed", {**_BUCKET, "shapes": [[-1]]}, "shapes [[-1]] is not a list of shapes"),
    ("/update_weights_from_distributed", {**_BUCKET, "dtypes": "float32"}, "dtypes 'float32' is not a list"),
    ("/update_weights_from_distributed", {**_BUCKET, "names": ["a", "b"]}, "names/dtypes/shapes lengths differ: 2/1/1"),
    ("/update_weights_from_distributed", {**_BUCKET, "names": ["model.norm.weight"] * 2, "dtypes": ["float32"] * 2,
                                          "shapes": [[64]] * 2}, "names lists 'model.norm.weight' more than once"),
    ("/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[64]]}, "names is missing"),
    ("/update_weights_from_distributed", {**_BUCKET, "group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/update_weights_from_distributed", {**_BUCKET, "flush_cache": "maybe"}, "flush_cache 'maybe' is not a boolean"),
    ("/update_weights_from_distributed", {**_BUCKET, "abort_all_requests": 2}, "abort_all_requests 2 is not a boolean"),
    ("/update_weights_from_distributed", {**_BUCKET, "load_format": "direct"}, "load_format 'direct' is not supported"),
    ("/update_weights_from_distributed", _BUCKET, "no weight group 'weight_update_group' (joined: none yet)"),
    ("/destroy_weights_update_group", {"group_name": [1]}, "group_name [1] is not a non-empty string"),
    ("/update_weights_from_disk", {"model_path": "MODEL", "abort_all_requests": "false"},
     "abort_all_requests 'false' is not a JSON boolean"),
    ("/pause_generation", {"mode": 5}, "mode 5 is not a non-empty string"),
    ("/abort_request", {"rid": ["a", "b"]}, "rid ['a', 'b'] is not a non-empty string"),
    ("/abort_request", {"rid": 5}, "rid 5 is not a non-empty string"),
    ("/abort_request", {"rid": ""}, "rid '' is not a non-empty string"),
    ("/abort_request", {}, 'rid is missing; send one request id as a string, {"rid": "..."}, or {"abort_all": true}'),
    ("/abort_request", {"abort_all": "true"}, "abort_all 'true' is not a JSON boolean"),
])
def test_a_field_of_the_wrong_json_type_is_a_json_400_naming_it(tiny_model_dir, path, body, words):
    # each body has one bad field, checked before anything runs: no join (world_size 1 would refuse
    # rank 1 anyway), no load, no abort; weight endpoints answer SGLang's {success, message}
    body = {k: str(tiny_model_dir) if v == "MODEL" else v for k, v in body.items()}

    async def main():
        async with running(tiny_model_dir, slots=2, max_seq_len=64) as (api, engine):
            return await api.post(path, body), engine.weight_version, engine._paused

    (status, out), version, paused = asyncio.run(main())
    assert status == 400 and isinstance(out, dict), out
    message = out["message"] if path.startswith(("/init", "/update", "/destroy")) else out["error"]["message"]
    assert words in message, message
    assert version == 0 and not paused


def test_text_prompts_are_tokenized_and_empty_text_is_named(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampling = {"max_new_tokens": 3, "temperature": 0.0}

    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            one = await api.post("/generate", {"text": "How many", "sampling_params": sampling})
            ids = await api.post("/generate", {"input_ids": tok("How many", add_special_tokens=False)["input_ids"],
                                               "sampling_params": sampling})
            batch = await api.post("/generate", {"text": ["How many", "apples"], "sampling_params": sampling})
            empty = await api.post("/generate", {"text": "", "sampling_params": sampling})
            empty_in_batch = await api.post("/generate", {"text": ["apples", ""], "sampling_params": sampling})
            return one, ids, batch, empty, empty_in_batch

    one, ids, batch, empty, empty_in_batch = asyncio.run(main())
    assert one[0] == ids[0] == batch[0] == 200
    assert one[1]["output_ids"] == ids[1]["output_ids"] == batch[1][0]["output_ids"]
    for status, out in (empty, empty_in_batch):
        assert status == 400 and "text '' has no tokens" in out["error"]["message"], out
        assert "input_ids" not in out["error"]["message"]


def test_return_logprob_false_returns_no_logprobs(tiny_model_dir):
    async def main():
        async with running(tiny_model_dir, max_seq_len=64) as (api, _):
            return [await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                                                 **flag}) for flag in ({"return_logprob": False}, {})]

    for status, out in asyncio.run(main()):
        assert status == 200 and "output_token_logprobs" not in out["meta_info"], out


def test_a_weight_update_without_group_name_names_the_default_and_the_joined_groups(tiny_model_dir):
    port = free_port()

    async def main():
        async with running(tiny_model_dir) as (api, _):
            joined = await _join_group(api, port, "g")
            return joined, await api.post("/update_weights_from_distributed", _BUCKET)

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
            unknown = await api.post("/update_weights_from_distributed", {**_BUCKET, "group_name": "g"})
            rejoined = await _join_group(api, again, "g")
            default = await api.post("/destroy_weights_update_group", {})
            return joined, answers, unknown, rejoined, default

    joined, (other, first, second), unknown, rejoined, default = asyncio.run(main())
    assert joined[0] == rejoined[0] == 200, (joined, rejoined)
    assert first == (200, {"success": True, "message": "destroyed weight group 'g'"})
    for answer in (other, second, default):  # default: SGLang's group_name, "weight_update_group", never joined
        assert answer == (400, {"success": False, "message": "The group to be destroyed does not exist."})
    assert unknown[0] == 400 and "no weight group 'g' (joined: none yet)" in unknown[1]["message"], unknown


def test_health_generate_answers_while_every_slot_is_busy(tiny_model_dir):
    # One slot, held by a long generation: the health probe's own request waits for the slot, but a
    # committed step of the long one proves the server alive (SGLang's rule), so the launcher's
    # health check does not take a busy server for a hung one.
    async def main():
        async with running(tiny_model_dir, slots=1) as (api, engine):
            long = asyncio.create_task(api.generate(prompt_ids(tiny_model_dir), max_new_tokens=200, ignore_eos=True))
            await engine.next_step()
            health = await api.get("/health_generate")
            busy = not long.done()
            await long
            return health, busy, engine.num_running

    health, busy, running_after = asyncio.run(main())
    assert health == (200, "") and busy and running_after == 0


def test_health_generate_answers_at_once_while_paused_for_an_update(tiny_model_dir):
    # a paused server makes no step until the update is in; it is alive, and must not be taken for
    # a hung one by the launcher's health check
    async def main():
        async with running(tiny_model_dir) as (api, engine):
            await api.post("/pause_generation", {"mode": "abort"})
            paused = await asyncio.wait_for(api.get("/health_generate"), 5)
            await api.post("/continue_generation", {})
            return paused, await api.get("/health_generate")

    assert asyncio.run(main()) == ((200, ""), (200, ""))


def nan_weights(model_dir, out_dir):
    """The tiny model with a NaN final norm, saved to ``out_dir``: every logit, so every
    log-prob, is NaN (broken weights, e.g. a diverged training step)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(out_dir)
    return out_dir


def test_health_generate_is_503_when_the_busy_step_commits_non_finite_log_probs(tiny_model_dir, tmp_path):
    # One slot, held by a long generation under broken weights: its committed steps prove the loop
    # alive but the weights broken (that request ends in a 500), so the probe answers 503 naming
    # the version, not 200 as for a step whose log-probs are finite
    nan_dir = nan_weights(tiny_model_dir, tmp_path / "nan")

    async def main():
        async with running(tiny_model_dir, slots=1) as (api, engine):
            loaded = await api.post("/update_weights_from_disk", {"model_path": str(nan_dir), "weight_version": "3"})
            body = {"input_ids": prompt_ids(tiny_model_dir), "sampling_params": {"max_new_tokens": 200,
                                                                                 "ignore_eos": True}}
            long = asyncio.create_task(api.post("/generate", body))
            await engine.next_step()
            health = await api.get("/health_generate")
            busy = not long.done()
            return loaded, health, busy, await long

    loaded, (status, out), busy, (long_status, _) = asyncio.run(main())
    assert loaded[0] == 200 and busy and long_status == 500
    assert status == 503 and "non-finite log-probs" in out["error"]["message"], out
    assert "under weight version 3" in out["error"]["message"], out


def _fail_next_prefill(engine) -> None:
    """Make the engine's next prefill raise, as a device fault would: its loop dies (``Engine.run``)."""
    def fault(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.forward.prefill = fault


_DEAD = "inference engine failed: RuntimeError: CUDA error: an illegal memory access was encountered"


def test_a_dead_engine_fails_health_and_ready_at_once(tiny_model_dir):
    # SGLang answers /ready and /health* 503 for an unhealthy server: a server whose engine loop
    # died serves nothing more, and its health answers must say so (with the error body), even
    # after a /continue_generation, which restarts nothing (nor may it queue requests for it)
    paths = ("/health", "/ready", "/health_generate")

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            before = [await api.get(p) for p in paths]
            _fail_next_prefill(engine)
            killing = await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            after = [await api.get(p) for p in paths]
            continued = await api.post("/continue_generation", {})
            # before: queued into the dead engine, never answered (the guard only bounds the failure)
            late = await asyncio.wait_for(api.post("/generate", {"input_ids": [1, 2]}), 60)
            return before, killing, after, continued, await api.get("/ready"), late

    before, killing, after, continued, ready, late = asyncio.run(main())
    assert before == [(200, "")] * 3
    assert killing == (500, {"error": {"message": killing[1]["error"]["message"]}}), killing
    assert _DEAD in killing[1]["error"]["message"]
    for path, (status, out) in zip(paths, after):
        assert status == 503 and _DEAD in out["error"]["message"], (path, status, out)
    assert continued[0] == 200 and ready[0] == 503 and _DEAD in ready[1]["error"]["message"], ready
    # the clients and the launcher read that /ready answer as a dead engine, not a pause
    assert engine_failure(json.dumps(ready[1]).encode()) == ready[1]["error"]["message"], ready
    assert late[0] == 500 and _DEAD in late[1]["error"]["message"], late


def test_requests_to_a_dead_engine_get_json_error_answers(tiny_model_dir):
    # the stream the engine dies under ends with SGLang's error event, then [DONE]; later calls
    # get HTTP 500 with the path's JSON error body (SGLang's, or OpenAI's under /v1), never
    # aiohttp's plain-text 500
    stream = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "stream": True}

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            _fail_next_prefill(engine)
            async with api.http.post(api.url + "/generate", json=stream) as resp:
                streamed = resp.status, await resp.read()
            answers = [
                await api.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
                await api.post("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0}),
                await api.post("/generate", stream),
                await api.post("/pause_generation", {"mode": "abort"}),
            ]
            completion = await api.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
            return streamed, answers, completion

    (status, raw), answers, completion = asyncio.run(main())
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""], raw
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "server_error" and _DEAD in error["message"], error
    for status, out in answers:
        assert status == 500 and isinstance(out, dict) and _DEAD in out["error"]["message"], (status, out)
    status, out = completion
    assert status == 500 and out["error"]["type"] == "server_error" and out["error"]["code"] == 500, out
    assert _DEAD in out["error"]["message"], out
