"""Flood one embedded inference server with concurrent ``/generate`` requests; print one table.

    PYTHONPATH=. python tools/load_generate.py [--requests 1000] [--new-tokens 16] [--prompt-len 16]
        [--max-running-requests 32] [--max-queued-requests 1024] [--threads 1] [--retry]
        [--model-path DIR] [--timeout-s 180]

Starts ``python -m areal_async.embedded.server`` as a subprocess on the CPU (a tiny random Llama,
2 layers, hidden 64, built with ``tests/support/models.py``'s ``build_tiny_model`` unless ``--model-path``
names an HF directory), waits for ``/health``, then sends all ``--requests`` at once from one
aiohttp session (no connection limit). Each asks for exactly ``--new-tokens`` tokens
(``ignore_eos``, temperature 1, its own ``sampling_seed``) after a random prompt of
``--prompt-len`` token ids. Each answer is counted as ``completed`` (HTTP 200 with
``--new-tokens`` output ids), ``refused`` (HTTP 503 with a ``Retry-After`` header: the waiting
queue was full, ``areal_async/embedded/engine/admission.py``) or ``failed`` (anything else: another
status, a 503 without the header, a connection error or ``--timeout-s``; the reasons are printed).
With ``--retry`` the requests go through ``InferenceClient`` instead, which waits out 503s (as the
rollout worker does): then every request should complete and ``refused`` counts the 503s it
waited out.

The server's memory is read from ``/proc/<pid>/status`` (Linux): ``VmRSS`` before the flood,
sampled every 20 ms during it (``peak rss``), and ``VmHWM`` (its lifetime peak) at the end; the
server must still answer ``/health`` afterwards. Exit status 1 if any request failed or the server
died.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import aiohttp

REPO = pathlib.Path(__file__).resolve().parents[1]


def _status_kib(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status`` in KiB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def _wait_healthy(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout_s:.0f} s")


async def _sample_rss(pid: int, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], _status_kib(pid, "VmRSS"))
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except asyncio.TimeoutError:
            pass


async def _raw(http: aiohttp.ClientSession, url: str, prompt: list[int], sampling: dict,
               timeout_s: float) -> tuple[str, float, str]:
    """One ``/generate``: ``(outcome, seconds, reason)``, outcome ``completed`` | ``refused`` | ``failed``."""
    t0 = time.perf_counter()
    try:
        async with http.post(url + "/generate", json={"input_ids": prompt, "sampling_params": sampling},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.json(content_type=None)
            seconds = time.perf_counter() - t0
            if resp.status == 200 and len(body.get("output_ids", [])) == sampling["max_new_tokens"]:
                return "completed", seconds, ""
            if resp.status == 503 and "Retry-After" in resp.headers:
                return "refused", seconds, ""
            return "failed", seconds, f"HTTP {resp.status}: {str(body)[:80]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return "failed", time.perf_counter() - t0, type(exc).__name__


async def _retrying(client, prompt: list[int], sampling: dict, rid: str) -> tuple[str, float, str]:
    from areal_async.inference.client import ServerError

    t0 = time.perf_counter()
    try:
        out = await client.generate(prompt, sampling, rid)
    except (ServerError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return "failed", time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc)[:80]}"
    ok = len(out.output_ids) == sampling["max_new_tokens"]
    return ("completed" if ok else "failed"), time.perf_counter() - t0, "" if ok else "short output"


async def _flood(args, url: str, proc: subprocess.Popen, vocab: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    sampling = [{"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 1.0, "sampling_seed": i}
                for i in range(args.requests)]
    connector = aiohttp.TCPConnector(limit=0)  # every request on its own connection, all at once
    async with aiohttp.ClientSession(connector=connector) as http:
        await _wait_healthy(http, url, proc, args.startup_timeout_s)
        # one request first: the forward's first call (allocation, kernel choice) is not the flood's
        await _raw(http, url, prompts[0], sampling[0], args.timeout_s)
        idle_kib, peak = _status_kib(proc.pid, "VmRSS"), [0]
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(proc.pid, stop, peak))
        refusals = 0
        t0 = time.perf_counter()
        if args.retry:
            from areal_async.inference.client import InferenceClient

            async with InferenceClient([url], timeout_s=args.timeout_s) as client:
                results = await asyncio.gather(*(_retrying(client, p, s, f"load-{i}")
                                                 for i, (p, s) in enumerate(zip(prompts, sampling))))
                refusals = client.refusals
        else:
            results = await asyncio.gather(*(_raw(http, url, p, s, args.timeout_s) for p, s in zip(prompts, sampling)))
        wall_s = time.perf_counter() - t0
        stop.set()
        await sampler
        healthy = False
        try:
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                healthy = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
    by = collections.defaultdict(list)
    for outcome, seconds, _ in results:
        by[outcome].append(seconds)
    return {"results": results, "by": by, "wall_s": wall_s, "idle_kib": idle_kib, "peak_kib": peak[0],
            "hwm_kib": _status_kib(proc.pid, "VmHWM"), "healthy": healthy and proc.poll() is None,
            "refusals": refusals if args.retry else len(by["refused"])}


def _table(args, r: dict) -> str:
    done, refused, failed = r["by"]["completed"], r["by"]["refused"], r["by"]["failed"]
    ms = lambda xs, q: f"{1000 * _percentile(xs, q):.0f}"  # noqa: E731
    rows = [
        ("requests at once", f"{args.requests} ({'InferenceClient, retries 503' if args.retry else 'raw aiohttp'})"),
        ("server", f"max_running_requests {args.max_running_requests}, max_queued_requests "
                   f"{args.max_queued_requests}, {args.threads} thread(s), {args.new_tokens} new tokens each"),
        ("completed", f"{len(done)}"),
        ("refused (503 + Retry-After)", f"{r['refusals']}" + (" (waited out)" if args.retry else "")),
        ("failed", f"{len(failed)}"),
        ("latency completed p50 / p99 ms", f"{ms(done, 0.5)} / {ms(done, 0.99)}"),
        ("latency refused p50 / p99 ms", f"{ms(refused, 0.5)} / {ms(refused, 0.99)}" if refused else "-"),
        ("wall s", f"{r['wall_s']:.2f}"),
        ("output tokens/s", f"{len(done) * args.new_tokens / r['wall_s']:.0f}"),
        ("server rss idle / peak / VmHWM MiB",
         f"{r['idle_kib'] / 1024:.0f} / {r['peak_kib'] / 1024:.0f} / {r['hwm_kib'] / 1024:.0f}"),
        ("server healthy after", "yes" if r["healthy"] else "NO"),
    ]
    reasons = collections.Counter(reason for outcome, _, reason in r["results"] if outcome == "failed")
    rows += [(f"  failed: {reason}", str(n)) for reason, n in reasons.most_common(5)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--retry", action="store_true", help="send through InferenceClient (waits out 503s)")
    p.add_argument("--model-path", default=None, help="an HF directory (default: a tiny random Llama)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per request")
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    for flag in ("requests", "new_tokens", "prompt_len", "max_running_requests", "max_queued_requests", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path
        if model is None:
            sys.path.insert(0, str(REPO))
            from tests.support.models import build_tiny_model

            model = str(build_tiny_model(pathlib.Path(tmp) / "tiny-llama"))
        from transformers import AutoConfig

        from areal_async.devices import free_port

        vocab = AutoConfig.from_pretrained(model).vocab_size
        port = free_port()
        cmd = [sys.executable, "-m", "areal_async.embedded.server", "--model-path", model, "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--threads", str(args.threads),
               "--max-running-requests", str(args.max_running_requests),
               "--max-queued-requests", str(args.max_queued_requests),
               "--max-seq-len", str(args.prompt_len + args.new_tokens + 8)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
        log = pathlib.Path(tmp) / "server.log"  # a file, not a pipe: a server that logs a lot never blocks on it
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            result = asyncio.run(_flood(args, f"http://127.0.0.1:{port}", proc, vocab))
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            err = log.read_text(errors="replace").strip()
    print(_table(args, result))
    if not result["healthy"]:
        print(f"the server did not survive the flood (exit {proc.returncode}):\n{err[-2000:]}", file=sys.stderr)
    return 0 if result["healthy"] and not result["by"]["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
