"""Timing and profiling of a callable that runs GPU work: median seconds and peak memory
(``measure``), the top kernels and the GPU's idle gaps under ``torch.profiler`` (``profile``)."""

from __future__ import annotations

import json
import time

import numpy as np
import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, reps: int, device, warmup: int = 1) -> tuple[float, float]:
    """Seconds per call (median of ``reps`` after ``warmup`` calls) and peak GiB allocated."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return float(np.median(times)), peak


def profile(fn, device, top: int = 18) -> None:
    """One iteration under ``torch.profiler``: the CUDA kernels with the most total time, the share
    of the wall time any kernel ran, and the GPU's idle gaps (``idle_gaps``)."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    _sync(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    print(f"\nprofile: wall {wall:.2f} s (profiled), kernels busy {busy:.2f} s ({busy / wall:.0%}), {launches} launches")
    for e in kernels[:top]:
        share = e.self_device_time_total / 1e6 / wall
        print(f"{e.self_device_time_total / 1e3:>9.1f} ms {share:>6.1%} {e.count:>6}x  {e.key[:100]}")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        idle_gaps(json.load(open(f.name)), wall)


def idle_gaps(trace: dict, wall: float, min_gap_us: float = 20.0, top: int = 12) -> None:
    """Where the GPU waited, from a Chrome trace of ``torch.profiler``: the union of all kernel and
    memcpy intervals (any stream) leaves gaps; each gap of at least ``min_gap_us`` is charged to the
    innermost host operation that launched the first kernel after it (the launch's correlation id
    links the two). Prints the idle total and the operations that account for most of it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device_ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                        key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in cpu_ops]

    def launcher(ts: float, tid) -> str:
        import bisect

        best = None  # the innermost (latest-starting) op on the launching thread that contains ts
        for i in range(bisect.bisect_right(starts, ts) - 1, max(-1, bisect.bisect_right(starts, ts) - 4000), -1):
            e = cpu_ops[i]
            if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]:
                best = e
                break
        return best["name"][:60] if best else "(no host op)"

    by_op: dict[str, list[float]] = {}
    end, idle, count = None, 0.0, 0
    for e in device_ops:
        if end is not None and e["ts"] - end >= min_gap_us:
            gap = e["ts"] - end
            launch = launches.get(e["args"].get("correlation"))
            name = launcher(launch["ts"], launch["tid"]) if launch else "(unknown launch)"
            by_op.setdefault(name, []).append(gap)
            idle += gap
            count += 1
        end = max(end or 0.0, e["ts"] + e["dur"])
    print(f"GPU idle in gaps >= {min_gap_us:.0f} us: {idle / 1e3:.1f} ms ({idle / 1e6 / wall:.1%} of the wall), "
          f"{count} gaps; by the host op that launched the kernel after the gap:")
    for name, gaps in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(gaps) / 1e3:>9.1f} ms {len(gaps):>6}x  max {max(gaps) / 1e3:.2f} ms  {name}")
