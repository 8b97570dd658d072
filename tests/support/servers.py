"""The embedded inference server for tests: in this process over real HTTP (``running``, with the
``Api`` helper that talks to it), or as a ``python -m areal_async.embedded.server`` subprocess.

Both serve the tiny fp32 models on the CPU. ``running`` yields the engine too, so a test can step
it or read its state; a subprocess is what a signal or a SIGKILL is sent to. ``JOIN`` and ``BUCKET``:
well-formed bodies of its weight endpoints, for tests that spoil one field or name a group.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import aiohttp
import torch

from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.devices import free_port

# /init_weights_update_group (rank 1 of 1: refused before any connection) and one
# /update_weights_from_distributed bucket of the tiny models' final norm
JOIN = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 1, "backend": "gloo"}
BUCKET = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}


@contextlib.asynccontextmanager
async def running(model_dir, slots: int = 8, max_seq_len: int = 256, dtype: str = "float32"):
    """An in-process server of ``model_dir`` (``slots`` running requests, weights in ``dtype``);
    yields ``(Api, engine)``."""
    engine, tokenizer = load_engine(str(model_dir), dtype, "cpu", slots, max_seq_len)
    async with serve(InferenceServer(engine, tokenizer, str(model_dir))) as url, aiohttp.ClientSession() as http:
        yield Api(url, http), engine


class Api:
    def __init__(self, url: str, http: aiohttp.ClientSession):
        self.url, self.http = url, http

    async def post(self, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        async with self.http.post(self.url + path, json=body) as resp:
            return resp.status, (await resp.json() if resp.content_type == "application/json" else await resp.text())

    async def get(self, path: str) -> tuple[int, dict | str]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, (await resp.json() if resp.content_type == "application/json" else await resp.text())

    async def generate(self, ids: list[int], rid: str | None = None, **sampling) -> dict:
        body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
        if rid is not None:
            body["rid"] = rid
        status, out = await self.post("/generate", body)
        assert status == 200, out
        return out


def server_logprobs(resp: dict) -> torch.Tensor:
    """The log-probs of a ``/generate`` answer's output tokens."""
    return torch.tensor([entry[0] for entry in resp["meta_info"]["output_token_logprobs"]])


def start_server(model_dir, port: int, *extra: str) -> subprocess.Popen:
    """An embedded server process on ``port`` (deterministic inference, float32, 1 thread, 4
    running requests, 256 tokens a sequence; ``extra``: more flags), its output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "areal_async.embedded.server", "--model-path", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--max-running-requests", "4", "--max-seq-len", "256", "--threads", "1",
         "--enable-deterministic-inference", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def server_process(model_dir, *extra: str):
    """``start_server`` on a free port; yields ``(url, proc)``; the process is killed at the end."""
    port = free_port()
    proc = start_server(model_dir, port, *extra)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
