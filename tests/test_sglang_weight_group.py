"""The weight-update group against SGLang's own code, in both directions, plus what runs everywhere.

- Our trainer's side of the group (``weight_group.new_weight_group`` as rank 0, ``broadcast_``)
  with a process of ``.venv-sglang`` running SGLang's server side: its ``WeightUpdater``
  (``init_weights_update_group`` → ``init_custom_process_group``, then
  ``receive_weights_from_distributed``), the tensors bit-equal after the update.
- The reverse: a process of ``.venv-sglang`` playing a slime/AReaL-style trainer (SGLang's
  helper as rank 0, AReaL's body with ``master_port`` as a string, one bucket per tensor and one
  ``flattened_bucket``) against the embedded server, the server's weights bit-equal to the sent
  ones and its generation that of the HF model holding them.
- Everywhere: the store keys our group writes are SGLang's (``<group>/<group>//cpu//...``), as
  rank 1 and as rank 0, watched on the store; a join that fails is answered and logged once,
  with no future left unretrieved.

SGLang's side runs torch 2.14.1 (its environment), ours torch 2.13: gloo across the two is what
a deployment with its own SGLang environment has too. Everything is gloo on CPU, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import gc
import json
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from areal_async import weight_group
from areal_async.dtypes import dtype_name
from tests.support.models import perturbed, prompt_ids, recompute_logprobs
from areal_async.devices import free_port
from tests.support.sglang_ref import needs_sglang, popen_sglang, run_sglang
from tests.support.servers import running, server_logprobs
from tests.support.weight_groups import host_group_in_thread, peer_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GROUP = "weight_update_group"


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---- our trainer side ↔ SGLang's server side --------------------------------------------------

# SGLang's server side, as its scheduler runs it: a default group first (the scheduler's TP group,
# which WeightUpdater asserts), then WeightUpdater's own two methods. Prints the received bytes.
_SGLANG_SERVER = r"""
import base64, datetime, json, socket, sys
import torch, torch.distributed as dist
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

job = json.load(sys.stdin)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    tp_port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=0, world_size=1)
updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                        get_model=None, update_model_fields=None, recapture_cuda_graph=None,
                        get_model_runner=None)
ok, message = updater.init_weights_update_group("127.0.0.1", job["port"], 1, 2, job["group_name"], backend="gloo")
assert ok, message
received = updater.receive_weights_from_distributed(names=job["names"], dtypes=job["dtypes"], shapes=job["shapes"],
                                                    group_name=job["group_name"])
print(json.dumps({"torch": torch.__version__, "names": [n for n, _ in received],
                  "bytes": [base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()
                            for _, t in received]}))
"""


@pytest.mark.sglang_ref
@needs_sglang
def test_our_trainer_side_broadcasts_into_sglangs_server_side():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(5, 8, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=gen),
        "lm_head.weight": torch.randn(3, 4, generator=gen).to(torch.float16),
        "model.step": torch.tensor([7, -2**40], dtype=torch.int64),
    }
    tensors["model.embed_tokens.weight"][0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])  # exact bits
    port = free_port()
    job = {"port": port, "group_name": GROUP, "names": list(tensors),
           "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
           "shapes": [list(t.shape) for t in tensors.values()]}
    out: dict = {}
    sglang = threading.Thread(target=lambda: out.update(run_sglang(_SGLANG_SERVER, job, timeout=240)), daemon=True)
    sglang.start()
    # the trainer's call; SGLang's side joins once its modules are imported (tens of seconds on a busy CPU)
    group = weight_group.new_weight_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=240)
    try:
        weight_group.broadcast_(group, list(tensors.values()))
        sglang.join(timeout=60)
    finally:
        weight_group.destroy_weight_group(group)
    assert out, "SGLang's side did not finish"
    assert out["torch"].startswith("2.14") and out["names"] == list(tensors)
    for (name, sent), got in zip(tensors.items(), out["bytes"]):
        assert base64.b64decode(got) == tensor_bytes(sent), name


# ---- a slime/AReaL-style trainer (SGLang's helper) ↔ the embedded server ------------------------

# rank 0 as slime's and AReaL's trainers are: SGLang's helper, the HTTP call in flight while the
# group forms and while the tensors are broadcast (torch.distributed.broadcast, async, names order)
_SGLANG_TRAINER = r"""
import datetime, json, sys, threading, urllib.error, urllib.request
import torch, torch.distributed as dist
from safetensors.torch import load_file
from sglang.srt.utils.common import init_custom_process_group
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

job = json.load(sys.stdin)

def post(path, body, out):
    request = urllib.request.Request(job["url"] + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            out.append((resp.status, json.loads(resp.read())))
    except urllib.error.HTTPError as e:
        out.append((e.code, json.loads(e.read())))

def during(path, body, work):
    out = []
    call = threading.Thread(target=post, args=(path, body, out))
    call.start()
    result = work()
    call.join()
    return out[0], result

name = job["group_name"]
join = {"master_address": "127.0.0.1", "master_port": str(job["port"]), "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"}  # AReaL sends the port as a string
joined, group = during("/init_weights_update_group", join, lambda: init_custom_process_group(
    backend="gloo", init_method=f"tcp://127.0.0.1:{job['port']}", world_size=2, rank=0, group_name=name,
    timeout=datetime.timedelta(seconds=60)))
weights = load_file(job["weights"])
names = list(weights)
half = len(names) // 2

def meta(ns):
    return {"names": ns, "dtypes": [str(weights[n].dtype).replace("torch.", "") for n in ns],
            "shapes": [list(weights[n].shape) for n in ns], "group_name": name, "flush_cache": True,
            "weight_version": "1"}

def per_tensor():
    for h in [dist.broadcast(weights[n], src=0, group=group, async_op=True) for n in names[:half]]:
        h.wait()

def flattened():
    bucket = FlattenedTensorBucket(named_tensors=[(n, weights[n]) for n in names[half:]])
    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)

first, _ = during("/update_weights_from_distributed", meta(names[:half]), per_tensor)
second, _ = during("/update_weights_from_distributed", {**meta(names[half:]), "load_format": "flattened_bucket"},
                   flattened)
print(json.dumps({"joined": joined, "first": first, "second": second}))
"""


@pytest.mark.sglang_ref
@needs_sglang
def test_an_sglang_style_trainer_updates_the_embedded_servers_weights(tiny_model_dir, tmp_path):
    new = perturbed(tiny_model_dir, seed=3)
    sent = {n: p.detach().clone() for n, p in new.named_parameters()}
    save_file(sent, tmp_path / "weights.safetensors")
    prompt = prompt_ids(tiny_model_dir)
    kw = dict(max_new_tokens=12, temperature=1.0, sampling_seed=4, ignore_eos=True)

    async def main():
        async with running(tiny_model_dir) as (api, engine):
            job = {"url": api.url, "port": free_port(), "group_name": GROUP, "weights": str(tmp_path / "weights.safetensors")}
            proc = popen_sglang(["-c", _SGLANG_TRAINER], stdin=-1, stdout=-1, stderr=-1, text=True)
            stdout, stderr = await asyncio.to_thread(proc.communicate, json.dumps(job), 240)
            assert proc.returncode == 0, stderr[-4000:]
            replies = json.loads(stdout.strip().splitlines()[-1])
            served = {n: t.detach().clone() for n, t in engine.forward.model.named_parameters()}
            return replies, served, await api.get("/get_weight_version"), await api.generate(prompt, **kw)

    replies, served, version, after = asyncio.run(main())
    assert replies["joined"][0] == 200 and replies["joined"][1]["success"], replies
    assert replies["first"][0] == 200 and replies["second"][0] == 200, replies
    assert version == (200, {"weight_version": "1"})
    assert served.keys() == sent.keys()
    for name, tensor in sent.items():
        assert tensor_bytes(served[name]) == tensor_bytes(tensor), name
    assert after["meta_info"]["weight_version"] == "1"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference.load_state_dict(sent, strict=False)  # the sent weights, loaded as HF loads them
    expected = recompute_logprobs(reference, prompt, after["output_ids"], 1.0)
    assert torch.allclose(server_logprobs(after), expected, atol=1e-5, rtol=0)


# ---- the store's keys (no .venv-sglang needed) --------------------------------------------------

# SGLang 0.5.23's init_custom_process_group, gloo, rank 1 of 2, group "g": the key it writes while
# it waits for rank 0 (seen on a store, test_sglangs_helper_writes_the_same_keys below)
def _sglang_key(group: str, rank: int) -> str:
    return f"{group}/{group}//cpu//0/{rank}"


def _watch_keys(store: dist.Store, want: int, timeout_s: float = 20.0) -> list[str]:
    """The store's keys once it holds ``want`` of them besides torch's own bookkeeping."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = sorted(k for k in store.list_keys() if not k.startswith("init/"))
        if len(keys) >= want:
            return keys
        time.sleep(0.02)
    raise AssertionError(f"the store holds {sorted(store.list_keys())} after {timeout_s} s")


@pytest.mark.parametrize("group", [GROUP, "g"])
def test_a_server_rank_writes_sglangs_keys(group):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    joined: dict = {}
    server = threading.Thread(target=lambda: joined.update(group=weight_group.new_weight_group(
        "gloo", "127.0.0.1", port, 1, 2, timeout_s=30, group_name=group)), daemon=True)
    server.start()
    keys = _watch_keys(store, 1)
    peer = peer_group(store, group, 0)  # rank 0 completes the join, so the thread ends
    server.join(timeout=30)
    assert keys == [_sglang_key(group, 1)]
    tensor = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    received = torch.empty(2, dtype=torch.bfloat16)
    send = threading.Thread(target=weight_group.broadcast_, args=(peer, [tensor]))
    send.start()
    weight_group.broadcast_(joined["group"], [received])
    send.join(timeout=30)
    weight_group.destroy_weight_group(joined["group"])
    assert torch.equal(received, tensor)


def test_the_trainer_rank_hosts_the_store_and_writes_sglangs_keys():
    trainer, joined, store = host_group_in_thread(free_port(), "g")
    keys = _watch_keys(store, 1)
    peer = peer_group(store, "g", 1)
    trainer.join(timeout=30)
    weight_group.destroy_weight_group(joined["group"])
    assert keys == [_sglang_key("g", 0)]
    assert peer.size() == 2


_SGLANG_KEYS = r"""
import datetime, json, os, sys, threading, time
import torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group

job = json.load(sys.stdin)
store = dist.TCPStore("127.0.0.1", job["port"], 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
def join():
    try:
        init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{job['port']}", world_size=2,
                                  rank=1, group_name=job["group"], timeout=datetime.timedelta(seconds=3))
    except Exception:
        pass  # nobody completes it: only its keys are wanted
threading.Thread(target=join, daemon=True).start()
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not [k for k in store.list_keys() if not k.startswith("init/")]:
    time.sleep(0.02)
print(json.dumps(sorted(k for k in store.list_keys() if not k.startswith("init/"))), flush=True)
os._exit(0)  # the join still waits in gloo's constructor: a normal exit would abort on it
"""


@pytest.mark.sglang_ref
@needs_sglang
def test_sglangs_helper_writes_the_same_keys():
    assert run_sglang(_SGLANG_KEYS, {"port": free_port(), "group": "g"}, timeout=240) == [_sglang_key("g", 1)]


# ---- a failed join: one answer, one log line, nothing unretrieved --------------------------------

def test_a_failed_join_is_answered_and_logged_once(tiny_model_dir, monkeypatch, caplog):
    def refused(*args, **kwargs):
        time.sleep(0.05)  # fails in its daemon thread after the handler started waiting
        raise dist.DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(weight_group, "new_weight_group", refused)
    unhandled: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        async with running(tiny_model_dir) as (api, _):
            reply = await api.post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 29612, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"})
            gc.collect()  # an unretrieved future reports itself when collected
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
        return reply

    with caplog.at_level(logging.WARNING, logger="areal_async.embedded.weight_api"):
        status, out = asyncio.run(main())
    assert status == 400 and out["message"] == ("init_weights_update_group failed: DistNetworkError: "
                                                "Connection reset by peer"), out
    assert [c.get("message") for c in unhandled] == []
    logged = [r.getMessage() for r in caplog.records if "DistNetworkError" in r.getMessage()]
    assert logged == [out["message"]]


def test_a_join_with_numeric_strings_is_read_as_sglang_reads_it(tiny_model_dir, monkeypatch):
    joins = []

    def join(*args, **kwargs):
        joins.append((args, kwargs))
        return object()  # stands for the group

    monkeypatch.setattr(weight_group, "new_weight_group", join)
    monkeypatch.setattr(weight_group, "destroy_weight_group", lambda group: None)  # at the server's exit
    bodies = [{"master_address": "127.0.0.1", "master_port": port, "rank_offset": "1", "world_size": "2",
               "backend": "gloo", "group_name": f"g{i}"}  # AReaL's string port, and pydantic's other forms
              for i, port in enumerate(["29612", " +29612 ", "29_612", "29612.00", 29612.0])]
    bodies.append({"master_address": "127.0.0.1", "master_port": "port", "rank_offset": 1, "world_size": 2})

    async def main():
        async with running(tiny_model_dir) as (api, _):
            return [await api.post("/init_weights_update_group", body) for body in bodies]

    replies = asyncio.run(main())
    assert [status for status, _ in replies] == [200] * 5 + [400], replies
    assert "master_port 'port' is not a port number" in replies[-1][1]["message"]
    assert joins == [(("gloo", "127.0.0.1", 29612, 1, 2), {"group_name": f"g{i}"}) for i in range(5)]


# what SGLang's pydantic schemas make of the weight endpoints' scalars: (field, JSON value)
_SCALARS = [("master_port", v) for v in (29612, "29612", " +29612 ", "29_612", "29612.00", 29612.0, "0029612",
                                          "abc", "1e3", "29612.5", 29612.5, "0x10", "29612.", "", None, [1])]
_SCALARS += [("world_size", v) for v in ("2", 2.0, "2.5", "two")] + [("rank_offset", v) for v in ("1", "+1", " 1")]
_SCALARS += [("flush_cache", v) for v in (True, False, "true", "False", "YES", "no", "on", "OFF", "t", "f", "y", "n",
                                          "1", "0", 1, 0, 1.0, 0.0, 2, 0.5, "", " true", "maybe", [True])]
_SCALARS += [("abort_all_requests", v) for v in ("true", 0, "2")]

_SGLANG_SCALARS = r"""
import json, sys
from pydantic import TypeAdapter
from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput

join = {"master_address": "127.0.0.1", "master_port": 29612, "rank_offset": 1, "world_size": 2}
bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
out = []
for field, value in json.load(sys.stdin):
    schema, base = ((InitWeightsUpdateGroupReqInput, join) if field in join else
                    (UpdateWeightsFromDistributedReqInput, bucket))
    try:  # FastAPI validates the parsed JSON body in python mode
        out.append([True, getattr(TypeAdapter(schema).validate_python({**base, field: value}), field)])
    except Exception:
        out.append([False, None])
print(json.dumps(out))
"""


@pytest.mark.sglang_ref
@needs_sglang
def test_the_weight_endpoints_read_scalars_as_sglangs_schemas_do():
    from areal_async.embedded.weight_requests import parse_bucket, parse_join

    sglang = run_sglang(_SGLANG_SCALARS, _SCALARS, timeout=240)
    join = {"master_address": "127.0.0.1", "master_port": 29612, "rank_offset": 1, "world_size": 2}
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
    ours = []
    for field, value in _SCALARS:
        parse, base = (parse_join, join) if field in join else (parse_bucket, bucket)
        try:
            ours.append([True, getattr(parse({**base, field: value}), field)])
        except ValueError:
            ours.append([False, None])
    differ = [(f, v, s, o) for (f, v), s, o in zip(_SCALARS, sglang, ours) if s != o]
    # the one difference by design: a null master_port is refused by both, but SGLang also refuses
    # a null of a defaulted field, which is "absent" here (none of those is in the table)
    assert differ == []


# ---- NCCL, from a trainer whose default group is bound to its GPU (needs 2 GPUs) -----------------

def _nccl_member(rank: int, port: int, default_port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from areal_async import weight_group

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    if rank == 0:  # the trainer: its default group bound to its GPU, as trainer/policy.py makes it
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1,
                                device_id=device)
    group = weight_group.new_weight_group("nccl", "127.0.0.1", port, rank, 2, timeout_s=120)
    tensor = (torch.arange(6, device=device) - 2.5).to(torch.bfloat16) if rank == 0 else \
        torch.empty(6, dtype=torch.bfloat16, device=device)
    weight_group.broadcast_(group, [tensor])
    torch.cuda.synchronize(device)
    results.put((rank, tensor.float().cpu().tolist()))
    weight_group.destroy_weight_group(group)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the trainer's and a server's")
def test_nccl_group_from_a_trainer_with_a_bound_default_group():
    # torch's helper would split the trainer's default communicator (a collective the server is not
    # in) when the default group is bound to a device; the group must be made through the store
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port, default_port = free_port(), free_port()
    procs = [ctx.Process(target=_nccl_member, args=(rank, port, default_port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert got[0] == got[1] == [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]
