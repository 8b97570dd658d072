"""Trainer → embedded-server weight updates (NCCL/gloo broadcast, or through disk): seconds, GB/s, checksums.

    python tools/bench_weight_sync.py [--shapes 0.6b 1.7b] [--trainer-device cuda:1]
        [--server-device cuda:0] [--bucket-mb 256] [--reps 3] [--sync distributed|disk] [--json out.json]
    python tools/bench_weight_sync.py --sync disk --shapes 0.6b --trainer-device cpu --server-device cpu

For each shape: a random Qwen3-shaped checkpoint (bf16) is written to a temporary directory; a
child process loads it into the real embedded server (``load_engine`` + ``InferenceServer``, HTTP
on a free port) on ``--server-device``; this process builds the trainer's policy from the same
directory (fp32 master weights, one-rank FSDP2, bf16 compute) on ``--trainer-device``, perturbs
every parameter (so an update that does nothing is caught), and runs ``DistributedWeightSender``:
``setup`` (group join; NCCL creates its communicator lazily, in the first send) once, then
``send(version)`` ``--reps`` times. Each send is timed end to end
(pause, per-parameter gather, bf16 cast, bucketed ``/update_weights_from_distributed`` calls with the
broadcast, resume). GB/s = bytes sent (bf16) / seconds. ``--sync disk`` times ``DiskWeightSender``
instead (the fallback when server and trainer share a GPU): gather, cast, write the version's HF
directory under the temporary directory, the server's ``/update_weights_from_disk`` (its read of
the files and load), resume.

Checksum: SHA-256 of every parameter's bytes, trainer side of the bf16 tensor it sent, server side of
the live parameter after the last update (the engine's fused q|k|v and gate|up weights are what
the HF parameters view). ``equal`` means all names match bit for bit; ``changed`` that the server's
weights differ from what it loaded at start.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import tempfile
import time

import torch


def checksums(named: dict[str, torch.Tensor], names, dtype: torch.dtype) -> dict[str, str]:
    out = {}
    for name in names:
        t = named[name].detach().to(dtype).contiguous().cpu()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _server(model_dir: str, device: str, url_q, done, result_q) -> None:
    from areal_async.embedded.http_server import InferenceServer, serve
    from areal_async.embedded.loading import load_engine

    async def main():
        engine, tokenizer = load_engine(model_dir, "bfloat16", device, max_running_requests=8, max_seq_len=256)
        named = engine.forward.named_tensors()
        names = [n for n, _ in engine.forward.model.named_parameters()]
        before = checksums(named, names, torch.bfloat16)
        async with serve(InferenceServer(engine, tokenizer, model_dir)) as url:
            url_q.put(url)
            await asyncio.to_thread(done.wait)
            result_q.put((before, checksums(named, names, torch.bfloat16), engine.weight_version))

    asyncio.run(main())


async def _trainer(policy, url: str, device: torch.device, bucket_bytes: int, reps: int, sync: str,
                   model_dir: str) -> tuple[list[float], float]:
    from areal_async.devices import free_port
    from areal_async.inference.client import InferenceClient
    from areal_async.trainer.weight_sync import DiskWeightSender, DistributedWeightSender

    async with InferenceClient([url]) as client:
        await client.wait_healthy(300)
        if sync == "disk":
            sender = DiskWeightSender(policy, client, 1, model_dir, pathlib.Path(model_dir).parent / "weights",
                                      torch.bfloat16)
        else:
            sender = DistributedWeightSender(policy, client, 1, "127.0.0.1", free_port(), bucket_bytes,
                                             torch.bfloat16, device)
        start = time.perf_counter()
        await sender.setup()
        setup_s = time.perf_counter() - start
        times = []
        for version in range(1, reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            await sender.send(version)
            times.append(time.perf_counter() - start)
            assert await client.get_weight_version(0) == version
        return times, setup_s


def bench_shape(shape: str, args) -> dict:
    import torch.distributed as dist

    from areal_async.config import TrainerConfig
    from areal_async.devices import free_port
    from areal_async.trainer.policy import build_policy, full_parameters, hf_model
    from qwen3_shapes import write_model_dir

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model_dir(shape, pathlib.Path(tmp) / "model"))
        url_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
        server = ctx.Process(target=_server, args=(model_dir, args.server_device, url_q, done, result_q))
        server.start()
        try:
            device = torch.device(args.trainer_device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    device_id=device if device.type == "cuda" else None)
            cfg = TrainerConfig(dtype="bfloat16", parallel="fsdp2")
            policy = build_policy(model_dir, cfg, device)
            with torch.no_grad():
                for p in hf_model(policy).parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shard (DTensor)
                    local.add_(torch.randn_like(local) * 1e-2)
            url = url_q.get(timeout=600)
            times, setup_s = asyncio.run(_trainer(policy, url, device, args.bucket_mb << 20, args.reps, args.sync,
                                                  model_dir))
            sent = {n: t.to(torch.bfloat16) for n, t in full_parameters(policy)}
            ours = checksums(sent, list(sent), torch.bfloat16)
            nbytes = sum(t.numel() * t.element_size() for t in sent.values())
            done.set()
            before, after, version = result_q.get(timeout=600)
        finally:
            done.set()
            server.join(timeout=120)
            if server.is_alive():
                server.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()
    return {
        "shape": shape, "bytes": nbytes, "tensors": len(sent), "setup_s": setup_s, "send_s": times,
        "best_s": min(times), "gb_per_s": nbytes / min(times) / 1e9, "server_version": version,
        "equal": after == ours, "changed": after != before,
        "mismatched": [n for n in ours if after.get(n) != ours[n]][:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["0.6b", "1.7b"])
    ap.add_argument("--trainer-device", default="cuda:1")
    ap.add_argument("--server-device", default="cuda:0")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sync", choices=["distributed", "disk"], default="distributed")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        rows.append(bench_shape(shape, args))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    how = f"buckets of {args.bucket_mb} MiB" if args.sync == "distributed" else "through disk"
    print(f"\nweight update ({args.sync}) trainer ({args.trainer_device}) -> embedded server ({args.server_device}), "
          f"bf16, {how}, best of {args.reps}")
    if args.sync == "distributed":
        print("(the first send includes the NCCL communicator's lazy initialisation)")
    print(f"{'shape':<6} {'GB':>6} {'tensors':>8} {'first s':>8} {'send s':>7} {'GB/s':>6} {'bitwise equal':>14} "
          f"{'changed':>8}")
    for r in rows:
        print(f"{r['shape']:<6} {r['bytes'] / 1e9:>6.2f} {r['tensors']:>8} {r['send_s'][0]:>8.2f} {r['best_s']:>7.3f} "
              f"{r['gb_per_s']:>6.1f} {str(r['equal']):>14} {str(r['changed']):>8}")


if __name__ == "__main__":
    main()
