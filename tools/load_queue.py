"""Drive the replay-queue service with many small lease + submit cycles; print one table.

    PYTHONPATH=. python tools/load_queue.py [--procs 2] [--clients 4] [--inflight 4] [--seconds 10]
        [--lease-groups 1] [--batch-size 256] [--profile]

Starts ``python -m areal_async.queue.server`` as a subprocess (throughput mode, ``max_staleness``
and ``max_concurrent`` large enough that admission never blocks a worker), then runs ``--procs``
client processes, each with ``--clients`` connections (``QueueClient``, one worker id each), each
connection with ``--inflight`` loops of ``lease(worker, --lease-groups)`` (default 1) then a
``submit`` of each leased group (one sample, 4 prompt and 4 output tokens: ~300 bytes). A trainer connection in this process takes
batch after batch (``get_batch``, then ``set_version``), so the staleness bound keeps admitting.
Reports the submits/s all clients achieved together over ``--seconds``, lease and submit latency
(p50 / p99), and the CPU each side used (the server's from ``/proc/<pid>/stat``, the clients'
from ``getrusage``; 100 % is one core): a server at ~100 % is the limit (one event loop), clients
at ~100 % each mean more client processes are needed. ``--profile`` runs the server under
cProfile and prints its 15 functions with the most own time (the profiler slows it down: the
rates of a profiled run are not the service's).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pathlib
import pstats
import resource
import signal
import subprocess
import sys
import tempfile
import time

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_async.queue.client import QueueClient  # noqa: E402
from areal_async.types import Array, Sample, Trajectory  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


def _group(g: int) -> Trajectory:
    sample = Sample(index=0, seed=g, output_ids=Array.of([1, 2, 3, 4], "int32"),
                    behav_logprobs=Array.of([-0.5] * 4, "float32"), versions=Array.of([0] * 4, "int32"),
                    finish_reason="length")
    return Trajectory(group_id=g, prompt_ids=Array.of([5, 6, 7, 8], "int32"), samples=[sample], data_index=g)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def _cycles(queue: QueueClient, worker_id: int, groups: int, until: float, lease_s: list,
                  submit_s: list) -> None:
    clock = time.perf_counter
    while clock() < until:
        t0 = clock()
        ids = await queue.lease(worker_id, groups)
        lease_s.append(clock() - t0)
        if not ids:  # the queue closed
            return
        for g in ids:
            t1 = clock()
            await queue.submit(_group(g))
            submit_s.append(clock() - t1)


async def _client_proc(port: int, first_worker: int, clients: int, inflight: int, groups: int, start: float,
                       seconds: float) -> dict:
    queues = [await QueueClient.connect("127.0.0.1", port, timeout_s=30) for _ in range(clients)]
    await asyncio.sleep(max(0.0, start - time.time()))  # every process starts at the same wall time
    until = time.perf_counter() + seconds
    lease_s: list[float] = []
    submit_s: list[float] = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for c, queue in enumerate(queues):
            for _ in range(inflight):
                tg.create_task(_cycles(queue, first_worker + c, groups, until, lease_s, submit_s))
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    for queue in queues:
        await queue.disconnect()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"lease_s": lease_s, "submit_s": submit_s, "elapsed": elapsed, "cpu_s": cpu}


def _run_client_proc(args: tuple, out) -> None:
    import uvloop

    out.send(uvloop.run(_client_proc(*args)))
    out.close()


async def _trainer(port: int, stop: asyncio.Event) -> int:
    """Take batches until ``stop``; returns how many groups it consumed."""
    consumed = 0
    async with await QueueClient.connect("127.0.0.1", port, timeout_s=30) as queue:
        step = 0
        while not stop.is_set():
            getting = asyncio.ensure_future(queue.get_batch(step))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([getting, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not getting.done():
                getting.cancel()
                break
            consumed += len(getting.result())
            step += 1
            await queue.set_version(step)
    return consumed


async def _drive(args, port: int, server_pid: int) -> dict:
    stop = asyncio.Event()
    trainer = asyncio.create_task(_trainer(port, stop))
    ctx = multiprocessing.get_context("spawn")
    start = time.time() + 3.0  # time for the spawned processes to import and connect
    procs, pipes = [], []
    for i in range(args.procs):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_run_client_proc, args=((port, 1 + i * args.clients, args.clients, args.inflight,
                                                          args.lease_groups, start, args.seconds), send))
        proc.start()
        procs.append(proc)
        pipes.append(recv)
    await asyncio.sleep(max(0.0, start - time.time()))
    cpu0, t0 = _cpu_s(server_pid), time.perf_counter()
    loop = asyncio.get_running_loop()
    results = [await loop.run_in_executor(None, pipe.recv) for pipe in pipes]
    server_cpu, wall = _cpu_s(server_pid) - cpu0, time.perf_counter() - t0
    for proc in procs:
        proc.join()
    stop.set()
    consumed = await trainer
    return {"results": results, "server_cpu_s": server_cpu, "wall_s": wall, "consumed": consumed}


def _table(args, r: dict) -> str:
    lease = [x for res in r["results"] for x in res["lease_s"]]
    submit = [x for res in r["results"] for x in res["submit_s"]]
    seconds = max(res["elapsed"] for res in r["results"])
    ms = lambda xs, q: f"{1000 * _percentile(xs, q):.2f}"  # noqa: E731
    client_cpu = [res["cpu_s"] / res["elapsed"] for res in r["results"]]
    rows = [
        ("clients", f"{args.procs} process(es) x {args.clients} connection(s) x {args.inflight} loop(s) in flight, "
                    f"{args.lease_groups} group(s) a lease{' (server under cProfile)' if args.profile else ''}"),
        ("submits", f"{len(submit)} in {seconds:.1f} s"),
        ("submits/s", f"{len(submit) / seconds:.0f}"),
        ("queue calls/s (lease + submit)", f"{(len(lease) + len(submit)) / seconds:.0f}"),
        ("lease p50 / p99 ms", f"{ms(lease, 0.5)} / {ms(lease, 0.99)}"),
        ("submit p50 / p99 ms", f"{ms(submit, 0.5)} / {ms(submit, 0.99)}"),
        ("server CPU", f"{100 * r['server_cpu_s'] / r['wall_s']:.0f} % of one core"),
        ("client CPU per process", " ".join(f"{100 * c:.0f} %" for c in client_cpu)),
        ("trainer consumed", f"{r['consumed']} groups (batch_size {args.batch_size})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _profile_table(path: pathlib.Path, top: int) -> str:
    """The ``top`` functions of a cProfile dump by own time, leaving out the event loop's ``run``
    (uvloop's C loop: its own time is the time it waited in epoll, i.e. idle)."""
    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(((tt, nc, ct, f"{pathlib.Path(f).name}:{line}({name})") for (f, line, name), (_, nc, tt, ct, _)
                   in stats.items() if not (f.endswith("runners.py") and name == "run")), reverse=True)[:top]
    lines = [f"\nserver profile (cProfile, top {top} by own time, event loop idle left out)",
             f"{'own s':>7} {'calls':>8} {'us/call':>8} {'cum s':>7}  function"]
    lines += [f"{tt:7.3f} {nc:8d} {1e6 * tt / max(nc, 1):8.1f} {ct:7.3f}  {name}" for tt, nc, ct, name in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--clients", type=int, default=4, help="connections per process (one worker id each)")
    p.add_argument("--inflight", type=int, default=4, help="lease + submit loops per connection")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--lease-groups", type=int, default=1, help="groups a lease asks for (each then submitted)")
    p.add_argument("--batch-size", type=int, default=256, help="groups per training batch (the trainer's get_batch)")
    p.add_argument("--profile", action="store_true", help="run the server under cProfile, print its top functions")
    args = p.parse_args(argv)
    for flag in ("procs", "clients", "inflight", "lease_groups", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        # admission never the limit: a staleness bound of 10^6 batches, max_concurrent above every loop
        cfg = {"name": "load-queue", "mode": "throughput",
               "queue": {"port": 0, "batch_size": args.batch_size, "max_staleness": 10**6,
                         "max_concurrent": 2 * args.procs * args.clients * args.inflight * args.lease_groups + 1}}
        config = pathlib.Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        profile = pathlib.Path(tmp) / "queue.prof"
        cmd = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if args.profile else []),
               "-m", "areal_async.queue.server", "--config", str(config)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("AREAL_ASYNC_TOKEN", None)  # loopback, no token: the clients send none
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = proc.stdout.readline()
            if not line.startswith("replay queue ready on"):
                raise RuntimeError(f"the queue server did not start: {line!r} (exit {proc.poll()})")
            port = int(line.split()[4].rsplit(":", 1)[1])
            import uvloop

            result = uvloop.run(_drive(args, port, proc.pid))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(_table(args, result))
        if args.profile and profile.exists():
            print(_profile_table(profile, 15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
