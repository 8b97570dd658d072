"""The embedded inference server: SGLang's HTTP endpoints (same JSON shapes) over ``Engine``.

This module is the command line (``parse_args``, ``main``); the endpoints are ``http_server.py``,
and ``loading.py`` builds the ``Engine``. ``python -m areal_async.embedded.server --model-path DIR``
(``--help`` lists the flags: SGLang's names and meanings where SGLang has them; docs/engine.md).
Bad flag values exit with argparse's usage line before the model loads; without a token the server
starts only on a loopback ``--host`` (``areal_async/auth.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import sys

import torch

from .. import auth, cpu_share
from ..dtypes import FLOAT_DTYPES
from ..devices import cuda_index, port_in_use
from ..jitter import Jitter
from ..config import DEFAULT_MAX_QUEUED
from . import fields
from .http_server import MAX_REQUEST_BYTES, InferenceServer, serve
from .loading import load_engine
from .lora import load_adapter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF causal-LM directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(FLOAT_DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=1024)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                   help="requests that may wait for a KV slot; one more is HTTP 503 with Retry-After (SGLang's flag)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--lora-paths", nargs="*", default=[], metavar="NAME=PATH",
                   help="a peft adapter directory merged into the weights before serving (SGLang's flag; one adapter)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant forward: results independent of the other requests")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: eager decode steps")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="compute every prompt in full (no reuse of cached prompts' keys and values)")
    p.add_argument("--prefix-cache-entries", type=int, default=8,
                   help="prompts the prefix cache holds, one KV row of --max-seq-len positions each")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="output tokens per streamed chunk (SGLang's flag; the first token is sent at once)")
    p.add_argument("--served-model-name", default=None, help="the model id of /v1/models (default: --model-path)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body accepted (HTTP 413 above it)")
    p.add_argument("--api-key", default=None,
                   help=f"token every path but /health* and /ready require as 'Authorization: Bearer' (default: ${auth.ENV})")
    p.add_argument("--debug-jitter-ms", type=float, default=0.0, help="random delay before each step")
    p.add_argument("--debug-jitter-seed", type=int, default=0)
    p.add_argument("--debug-jitter-stream", type=int, default=0, help="e.g. the server index")
    args = p.parse_args(argv)
    # bad values exit here with argparse's usage line (code 2), before the model loads
    for flag, value in (("--max-running-requests", args.max_running_requests), ("--max-seq-len", args.max_seq_len),
                        ("--max-prefill-tokens", args.max_prefill_tokens),
                        ("--max-queued-requests", args.max_queued_requests),
                        ("--prefix-cache-entries", args.prefix_cache_entries),
                        ("--stream-interval", args.stream_interval),
                        ("--max-request-bytes", args.max_request_bytes)):
        if value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    args.api_key = args.api_key or auth.job_token()
    try:
        auth.require_token(args.host, args.api_key, f"the inference server (--host {args.host})")
    except ValueError as exc:
        p.error(str(exc))
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: must be in [0, 65535] (0 picks a free port)")
    why = port_in_use(args.host, args.port) if args.port else None
    if why:
        p.error(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({why}); "
                f"another process holds it, pick another port (0 picks a free one)")
    if not 0 <= args.weight_version < fields.MAX_WEIGHT_VERSION:
        p.error(f"--weight-version {args.weight_version}: must be >= 0 and < 2**63 (the policy version "
                f"being served)")
    if len(args.lora_paths) > 1 or any("=" not in spec for spec in args.lora_paths):
        p.error(f"--lora-paths {' '.join(args.lora_paths)}: give one NAME=PATH (this server merges one adapter)")
    if not (pathlib.Path(args.model_path) / "config.json").is_file():
        p.error(f"--model-path {args.model_path!r}: not an HF model directory (no config.json there)")
    try:
        cuda_index("--device", args.device, torch.cuda.is_available())
    except ValueError as exc:
        p.error(str(exc))
    return args


async def main(argv: list[str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; exits with the engine's error if the engine loop dies."""
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    jitter = Jitter(args.debug_jitter_ms, args.debug_jitter_seed, "server", args.debug_jitter_stream)
    engine, tokenizer = load_engine(args.model_path, args.dtype, args.device, args.max_running_requests,
                                    args.max_seq_len, args.max_prefill_tokens, args.weight_version,
                                    args.enable_deterministic_inference, jitter if jitter.enabled else None,
                                    cuda_graph=not args.disable_cuda_graph,
                                    prefix_cache=not args.disable_radix_cache,
                                    prefix_cache_entries=args.prefix_cache_entries,
                                    max_queued_requests=args.max_queued_requests)
    for spec in args.lora_paths:  # a resumed LoRA job's servers: the base model and the checkpoint's adapter
        name, _, path = spec.partition("=")
        load_adapter(engine, name, pathlib.Path(path))
    engine.cpu_share = cpu_share.from_environment()  # cpu_threads: adaptive (launcher.local sets it)
    server = InferenceServer(engine, tokenizer, args.model_path, args.stream_interval, args.served_model_name,
                             token=args.api_key, max_request_bytes=args.max_request_bytes)
    async with serve(server, args.host, args.port) as url:
        mode = "deterministic" if args.enable_deterministic_inference else "throughput"
        print(f"inference server on {url} ({args.model_path}, {args.dtype}, {args.device}, {mode})", flush=True)
        await _wait_for_stop(server)


async def _wait_for_stop(server: InferenceServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([stop_task, server.engine_task], return_when=asyncio.FIRST_COMPLETED)
    engine_error = server.engine_task.done() and not server.engine_task.cancelled() and server.engine_task.exception()
    stop_task.cancel()
    if engine_error:
        raise engine_error


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
    # A weight-group call may still be blocked in its daemon thread (a broadcast that never came,
    # a join whose peers never did): a normal interpreter exit would destroy its gloo/NCCL objects
    # under it, whose C++ threads then abort the process (SIGABRT, "terminate called without an
    # active exception"). Everything is answered and flushed here; leave without destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
