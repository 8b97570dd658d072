"""The launcher's inference servers: their command lines, health probes and restarts.

``SERVER_ARGV[inference.backend]`` builds the embedded server's or ``sglang.launch_server``'s
command line (the same flags where SGLang has them); ``ServerProbe`` asks ``GET /ready`` before
``GET /health_generate``, so a paused server is not taken for a hung one; ``server_failed`` and
``restart_argv`` start a dead one again, from the disk sync's newest weights, or a LoRA job's
base model with its newest adapter (docs/faults.md#an-inference-server-dies-or-hangs). Used by
``launcher.local.run_job``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Callable

import msgspec

from areal_async.config import Config, DebugConfig, InferenceConfig, ModelConfig
from areal_async.inference.client import LORA_NAME
from launcher import restart_weights
from launcher.supervisor import Supervisor

PY = sys.executable


def embedded_server_argv(cfg: InferenceConfig, model: ModelConfig, port: int, mode: str,
                         threads: int, debug: DebugConfig = DebugConfig(),
                         weight_version: int = 0, token: str | None = None, lora: Sequence[str] = ()) -> list[str]:
    """Command line of one embedded inference server (flags mirror sglang.launch_server);
    ``debug.jitter_ms`` becomes a per-step delay, seeded by ``jitter_seed`` and the port; ``lora``:
    the adapter's flags (``_server_argv``). The ``token`` is not on it: the server reads
    ``AREAL_ASYNC_TOKEN`` from its environment."""
    argv = [PY, "-m", "areal_async.embedded.server", "--model-path", model.path,
            "--host", cfg.host, "--port", str(port), "--dtype", model.dtype,
            "--max-request-bytes", str(cfg.max_request_bytes),
            "--device", cfg.device, "--max-running-requests", str(cfg.max_running_requests),
            "--max-queued-requests", str(cfg.max_queued_requests),
            "--max-seq-len", str(cfg.max_seq_len), "--threads", str(threads),
            "--weight-version", str(weight_version), "--prefix-cache-entries", str(cfg.prefix_cache_entries)]
    argv += _engine_flags(cfg, mode)
    if debug.jitter_ms > 0:
        argv += ["--debug-jitter-ms", str(debug.jitter_ms), "--debug-jitter-seed",
                 str(debug.jitter_seed), "--debug-jitter-stream", str(port)]
    return argv + list(lora)


def sglang_server_argv(cfg: InferenceConfig, model: ModelConfig, port: int, mode: str,
                       threads: int, debug: DebugConfig = DebugConfig(),
                       weight_version: int = 0, token: str | None = None, lora: Sequence[str] = ()) -> list[str]:
    """Command line of one real SGLang server (``python -m sglang.launch_server``); SGLang has
    no step jitter, so ``debug`` is ignored, nor a body limit (``max_request_bytes``). ``token``
    becomes ``--api-key`` (SGLang reads it from no environment variable), so it shows in the
    process list of this machine's users. ``lora``: the adapter's flags (``_server_argv``), before
    ``inference.sglang_args``, which may override them."""
    argv = [PY, "-m", "sglang.launch_server", "--model-path", model.path, "--host", cfg.host,
            "--port", str(port), "--dtype", model.dtype,
            "--max-running-requests", str(cfg.max_running_requests),
            "--max-queued-requests", str(cfg.max_queued_requests),
            "--context-length", str(cfg.max_seq_len),
            # The client needs integer versions; SGLang's default weight version is "default".
            "--weight-version", str(weight_version)]
    argv += _engine_flags(cfg, mode)
    if token:
        argv.append(f"--api-key={token}")  # one word: a token may start with "-", which argparse would take for a flag
    return argv + list(lora) + list(cfg.sglang_args)


# SGLang's adapter slots per batch: the policy's, and the base model's for the requests naming no
# adapter (the launcher's /health_generate probes)
SGLANG_LORAS_PER_BATCH = 2


def sglang_lora_flags(rank: int, target_modules: Sequence[str]) -> list[str]:
    """SGLang's flags for serving a LoRA adapter of rank ``rank`` on ``target_modules`` (its
    ``--lora-paths`` comes with the adapter, ``_server_argv``)."""
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras-per-batch", str(SGLANG_LORAS_PER_BATCH),
            "--lora-target-modules", *target_modules]


def sglang_lora_start(cfg: Config, adapter: pathlib.Path | None) -> tuple[pathlib.Path, list[str]]:
    """For a LoRA job on SGLang, which serves the base model to a request naming no loaded adapter:
    the adapter its servers start with under the name ``policy`` (``adapter``, a resumed job's
    checkpoint, or else version 0, ``lora.initial_adapter`` in ``model.dtype``, written to
    ``RUN_DIR/adapters/v0`` with ``lora_base.json``) and ``sglang_lora_flags`` for ``trainer.lora``. Call after
    ``remove_stale_weights``."""
    from areal_async.dtypes import FLOAT_DTYPES, dtype_from_name
    from areal_async.trainer.lora import initial_adapter
    from areal_async.trainer.lora_sync import write_adapter_dir

    dtype = dtype_from_name(cfg.model.dtype, FLOAT_DTYPES, "model.dtype")
    tensors, config = initial_adapter(cfg.model.path, cfg.trainer.lora, dtype)
    if adapter is None:
        adapter = write_adapter_dir(cfg.run_dir / "adapters" / "v0", tensors, config, dtype).resolve()
    return adapter, sglang_lora_flags(config["r"], config["target_modules"])


def _engine_flags(cfg: InferenceConfig, mode: str) -> list[str]:
    """The switches both backends take under SGLang's names."""
    return ((["--enable-deterministic-inference"] if mode == "deterministic" else [])
            + ([] if cfg.cuda_graph else ["--disable-cuda-graph"])
            + ([] if cfg.prefix_cache else ["--disable-radix-cache"]))


SERVER_ARGV = {"embedded": embedded_server_argv, "sglang": sglang_server_argv}


def check_backend(cfg: InferenceConfig) -> None:
    """Raise ``ValueError`` if the servers of ``inference.backend`` cannot start here: they run
    as ``PY -m <module>``, so ``sglang`` needs SGLang installed for this Python."""
    if cfg.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ValueError(f"inference.backend=sglang but SGLang is not installed for {PY}; install it "
                         f"there (pip install sglang) or set inference.backend=embedded")


def http_answer(url: str, timeout_s: float, max_bytes: int = 4096) -> tuple[int | None, bytes]:
    """The HTTP status of ``GET url`` within ``timeout_s`` seconds and, for an error status, the
    first ``max_bytes`` of its body (``b""`` for a success); ``(None, b"")`` without an answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, b""
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read(max_bytes)
        except OSError:  # the connection dropped while the error body was read
            return exc.code, b""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None, b""


def http_status(url: str, timeout_s: float) -> int | None:
    """The HTTP status of ``GET url`` within ``timeout_s`` seconds, ``None`` without an answer."""
    return http_answer(url, timeout_s)[0]


class ServerProbe:
    """The launcher's health probe of one inference server (``HealthCheck.probe``): a check of
    ``/health_generate`` first asks ``GET /ready``: a paused server (503) passes without a
    generation for up to ``max_pause_s`` seconds in a row (SGLang's ``/health_generate`` waits
    behind a pause and then fails), one whose 503 names a dead engine fails at once
    (``routing.Readiness``); other paths as ``probe_http``."""

    def __init__(self, url: str, max_pause_s: float):
        from areal_async.inference.routing import Readiness

        self.url, self.readiness = url, Readiness(max_pause_s)

    def __call__(self, path: str, timeout_s: float) -> str | None:
        if path == "/health_generate":
            status, body = http_answer(self.url + "/ready", min(timeout_s, 5.0))
            paused = self.readiness.judge(self.url, status, time.monotonic(), body)
            if paused is True:
                return None
            if paused is not False:
                return paused
        return probe_http(self.url, path, timeout_s)


def probe_http(url: str, path: str, timeout_s: float) -> str | None:
    """``None`` if ``GET url + path`` answers 200 within ``timeout_s`` seconds, else why not."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read(300).decode(errors='replace')}"
    except (TimeoutError, socket.timeout):
        return f"no answer within {timeout_s:g} s"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            return f"no answer within {timeout_s:g} s"
        return str(exc.reason)
    except OSError as exc:  # e.g. the connection reset while the answer was read
        return f"{type(exc).__name__}: {exc}"


def server_failed(cfg: Config, token: str | None, sup: Supervisor, server: int, why: str) -> str:
    """Before inference server ``server`` is started again (``why``: how it died): the queue counts
    it (``rollout/server_failures``, ``rollout/server_restarts``); returns a note for the
    launcher's line.

    Raises:
        RuntimeError: one server only without disk sync (nothing would generate meanwhile nor give
            the restarted server the current weights), or the job was still starting (no queue
            yet): the job stops with the server's error.
        ConnectionError, TimeoutError: the queue is not reachable (10 s) or does not answer (30 s).
    """
    from areal_async.queue.client import QueueClient

    if cfg.inference.num_servers == 1 and cfg.trainer.weight_sync != "disk":
        raise RuntimeError("a job with one inference server cannot go on without it (nothing would generate "
                           "meanwhile nor give the restarted server the current weights); set "
                           "trainer.weight_sync=disk (a restart starts from the newest weights directory) or "
                           "inference.num_servers=2 or more to survive the death of a server")
    if not any(child.name == "queue" for child in sup.children):
        raise RuntimeError("it died while the job was starting")

    async def count() -> None:
        async with await QueueClient.connect(cfg.queue.host, cfg.queue.port, timeout_s=10.0, token=token) as q:
            await asyncio.wait_for(q.server_failed(server, restart=True), 30.0)

    asyncio.run(count())
    if cfg.trainer.weight_sync != "disk":
        return ("it starts again on its port as it first started and rejoins the generation once the next weight "
                "update has given it the current weights")
    newest = "adapter of RUN_DIR/adapters" if cfg.trainer.lora.rank else "weights of RUN_DIR/weights"
    return (f"it starts again on its port from the newest {newest} (as it first started before the first update) "
            "and rejoins the generation once it answers")


def remove_stale_weights(run_dir: pathlib.Path) -> None:
    """Remove ``RUN_DIR/weights``, ``RUN_DIR/adapters`` and ``RUN_DIR/restart_weights`` before a
    job with disk sync starts: the versions a stopped job wrote are not this job's (a resumed job's
    checkpoint may be older than them), so a restarted server must never start from one."""
    for stale in ("weights", "adapters", "restart_weights"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)


def _server_argv(make_argv: Callable[..., list[str]], inf: InferenceConfig, port: int, mode: str, threads: int,
                 debug: DebugConfig, token: str | None, model: ModelConfig, version: int,
                 adapter: pathlib.Path | None = None, *, lora_flags: Sequence[str] = ()) -> list[str]:
    """``make_argv``'s command line; with ``adapter``, ``lora_flags`` (SGLang's: ``sglang_lora_flags``)
    and ``--lora-paths policy=ADAPTER`` (served from the start: the embedded server merges it)."""
    lora = () if adapter is None else [*lora_flags, "--lora-paths", f"{LORA_NAME}={adapter}"]
    return make_argv(inf, model, port, mode, threads, debug, version, token, lora=lora)


def restart_argv(run_dir: pathlib.Path, server: int,
                 argv: Callable[[ModelConfig, int, pathlib.Path | None], list[str]], model: ModelConfig,
                 version: int, adapter: pathlib.Path | None = None, lora: bool = False) -> list[str]:
    """The command line of inference server ``server`` started again (``trainer.weight_sync=disk``),
    ``argv(model, version, adapter)``: full weights from the newest complete
    ``RUN_DIR/weights/v{N}/``; with ``lora`` (``trainer.lora.rank > 0``) ``model`` with the newest
    complete adapter ``RUN_DIR/adapters/v{N}/``. Either is linked into
    ``RUN_DIR/restart_weights/server{i}/`` so that the trainer's removal of it cannot pull it away
    while the server loads it (``launcher/restart_weights.py``), and served at version N; when there
    is none yet, as it first started: ``model`` and ``adapter`` (``None``: none) at ``version``."""
    source = run_dir / ("adapters" if lora else "weights")
    pinned = restart_weights.pin(source, run_dir / "restart_weights" / f"server{server}")
    if pinned is not None:
        version, path = pinned
        if lora:
            adapter = path.resolve()
        else:
            model = msgspec.structs.replace(model, path=str(path.resolve()))
    with_adapter = f" with adapter {adapter}" if adapter is not None else ""
    print(f"[launcher] server{server} starts from {model.path}{with_adapter} (weight version {version})", flush=True)
    return argv(model, version, adapter)
