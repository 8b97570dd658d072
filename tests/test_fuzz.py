"""Fuzzing the embedded server's JSON handlers and the queue's msgpack frames (``hypothesis``).

Every body that is not a JSON object gets HTTP 400 (413 over the limit), every other body a
status below 500, and a good request right after each one succeeds; the queue answers every
frame that is not a request with ``BadRequest`` and every bad request with ``ValueError`` (never
an ``internal`` error, which would stop the queue), and goes on serving the same connection.
Both run with the job's token, so the handlers behind the check are what is fuzzed; a third test
fuzzes the ``Authorization`` header itself. Short runs (``max_examples`` 40-150, no deadline):
seconds each.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import urllib.parse

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from areal_async import auth
from areal_async.config import QueueConfig
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.queue import protocol as p
from areal_async.queue.core import ReplayQueue
from areal_async.queue.server import serve as serve_queue

TOKEN = "fuzz-token"
LIMIT = 64 * 1024  # the fuzzed server's body limit
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

# POST endpoints that read a JSON body. /init_weights_update_group gets only bodies that cannot
# form a join (no world_size key): a join that parses waits up to 300 s for its peers.
# (/continue_generation and /flush_cache read no body, as on SGLang.)
POSTS = ["/generate", "/abort_request", "/pause_generation", "/update_weights_from_distributed", "/update_weights_from_disk", "/v1/completions",
         "/v1/chat/completions"]
KEYS = ["input_ids", "text", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len",
        "max_new_tokens", "temperature", "mode", "abort_all", "names", "dtypes", "shapes", "group_name",
        "weight_version", "load_format", "model_path", "model", "prompt", "messages", "max_tokens", "n"]
odd = st.sampled_from([0, -1, 1, 2**63, -(2**63), 1e308, "", "abort", "in_place", "float32", [], {}, [[]], [[1, 2]],
                       [1, 2, 3], [-5], [10**9], ["a"], {"max_new_tokens": 2**40}, {"temperature": -1},
                       {"stop": [[]]}, {"role": "user"}, [{"role": "user", "content": 3}], "flattened_bucket"])
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12) | odd
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4),
                           max_leaves=16)
objects = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)
not_objects = (st.binary(max_size=200)  # mostly not JSON, often not UTF-8
               | json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())
               | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")))
GOOD = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).encode()


def _in_thread(start):
    """Run ``start()`` (an async context manager yielding a value) in a loop of its own thread;
    returns ``(value, stop)``."""
    ready, box = threading.Event(), {}

    async def main():
        box["stop"] = asyncio.Event()
        async with start() as value:
            box["value"] = value
            ready.set()
            await box["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(120), "the fuzzed service did not start"

    def stop():
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)

    return box["value"], stop


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine, tokenizer = load_engine(str(tiny_model_dir), "float32", "cpu", 4, 128)
    url, stop = _in_thread(lambda: serve(InferenceServer(engine, tokenizer, str(tiny_model_dir), token=TOKEN,
                                                         max_request_bytes=LIMIT)))
    yield url
    stop()
    torch.set_num_threads(threads)


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> int:
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json",
                                          **(auth.bearer_headers(TOKEN) if headers is None else headers)})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def still_serving(url: str) -> None:
    assert post(url, "/continue_generation", b"{}") == 200  # undo a pause a fuzzed body may have made
    assert post(url, "/generate", GOOD) == 200, "a good request after a fuzzed one failed"


@FUZZ
@given(path=st.sampled_from(POSTS + ["/init_weights_update_group"]), body=not_objects)
@example(path="/generate", body=b"[" * 20_000 + b"]" * 20_000)  # nested deeper than Python's recursion limit
@example(path="/v1/completions", body=b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")
@example(path="/generate", body=b"\xff\xfe{}")  # not UTF-8
@example(path="/generate", body=b"x" * (LIMIT + 1))  # over the limit: 413
def test_a_body_that_is_not_a_json_object_is_a_4xx(server_url, path, body):
    status = post(server_url, path, body)
    if len(body) > LIMIT:
        assert status == 413
    elif body == b"" and path in ("/pause_generation", "/abort_request"):
        assert status < 500  # no body: no fields, their defaults (abort_request then needs a rid: 400)
    else:
        assert 400 <= status < 500, (path, body[:80], status)
    still_serving(server_url)


@settings(FUZZ, max_examples=150)
@given(path=st.sampled_from(POSTS), body=objects)
def test_a_json_object_of_any_fields_is_never_a_5xx(server_url, path, body):
    status = post(server_url, path, json.dumps(body).encode())
    assert status < 500, (path, body, status)
    still_serving(server_url)


@settings(FUZZ, max_examples=40)
@given(body=st.dictionaries(st.sampled_from(["master_address", "master_port", "rank_offset", "backend",
                                             "group_name"]), json_values, max_size=5))
def test_a_join_without_world_size_is_a_4xx(server_url, body):
    assert 400 <= post(server_url, "/init_weights_update_group", json.dumps(body).encode()) < 500
    still_serving(server_url)


@settings(FUZZ, max_examples=60)
@given(header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
@example(header=f"bearer {TOKEN}")
@example(header=f"Bearer {TOKEN}x")
def test_only_the_bearer_token_gets_past_the_check(server_url, header):
    status = post(server_url, "/pause_generation", b'{"mode": "abort"}', {"Authorization": header})
    parts = header.split(" ", 1)
    accepted = len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == TOKEN
    assert status == (200 if accepted else 401), (header, status)
    still_serving(server_url)


# ---- the queue's frames ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def queue_port():
    import contextlib

    @contextlib.asynccontextmanager
    async def start():
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=1, max_concurrent=8), "deterministic")
        handler, server = await serve_queue(queue, "127.0.0.1", 0, token=TOKEN, max_request_bytes=LIMIT)
        try:
            yield server.sockets[0].getsockname()[1], handler
        finally:
            server.close()

    (port, handler), stop = _in_thread(start)
    yield port, handler
    stop()


class Frames:
    """A blocking connection to the queue, authenticated."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = self.sock.makefile("rb")
        assert isinstance(self.call(msgspec.msgpack.encode(p.Auth(rid=0, token=TOKEN))), p.Ack)

    def call(self, payload: bytes):
        self.sock.sendall(len(payload).to_bytes(4, "big") + payload)
        size = int.from_bytes(self.reader.read(4), "big")
        return msgspec.msgpack.decode(self.reader.read(size), type=p.Reply)

    def close(self):
        self.reader.close()
        self.sock.close()


# requests that answer at once (lease, get_batch and wait_drained may block by design; close ends the queue)
OPS = ["submit", "reject", "setversion", "peekready", "getstats", "auth", "lease2", ""]
FIELDS = ["rid", "traj", "group_id", "reason", "version", "below", "token", "worker_id", "max_groups",
          "prompt_ids", "samples", "data_index"]
packable = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
            | st.binary(max_size=16) | odd)  # msgpack's integers: [-2**63, 2**64)
msgpack_values = st.recursive(packable, lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=4),
                              max_leaves=16)
near_requests = st.builds(lambda op, fields: {"op": op, **fields}, st.sampled_from(OPS),
                          st.dictionaries(st.sampled_from(FIELDS), msgpack_values, max_size=4))
frames = (st.binary(max_size=200) | msgpack_values.map(msgspec.msgpack.encode)
          | near_requests.map(msgspec.msgpack.encode))


@settings(FUZZ, max_examples=150)
@given(payload=frames)
@example(payload=b"\x91" * 10_000)  # arrays nested 10,000 deep
@example(payload=msgspec.msgpack.encode({"op": "reject", "rid": 1, "group_id": 2**63 - 1, "reason": "x"}))
@example(payload=msgspec.msgpack.encode({"op": "setversion", "rid": 1, "version": -1}))
def test_a_bad_frame_is_answered_and_the_queue_goes_on(queue_port, payload):
    port, handler = queue_port
    conn = Frames(port)
    try:
        reply = conn.call(payload)
        if isinstance(reply, p.Error):
            assert reply.kind in ("BadRequest", "ValueError"), reply
        assert not handler.failed.done(), "a frame stopped the queue"
        assert isinstance(conn.call(msgspec.msgpack.encode(p.GetStats(rid=7))), p.Stats)
    finally:
        conn.close()


def test_a_frame_over_the_limit_closes_its_connection_only(queue_port):
    port, handler = queue_port
    conn = Frames(port)
    # the length prefix alone: the queue must refuse before reading the payload
    conn.sock.sendall((LIMIT + 1).to_bytes(4, "big"))
    size = int.from_bytes(conn.reader.read(4), "big")
    reply = msgspec.msgpack.decode(conn.reader.read(size), type=p.Reply)
    assert isinstance(reply, p.Error) and reply.kind == "TooLarge" and reply.rid == p.CONNECTION
    assert conn.reader.read(1) == b""  # closed
    conn.close()
    conn = Frames(port)
    assert isinstance(conn.call(msgspec.msgpack.encode(p.GetStats(rid=1))), p.Stats)
    conn.close()
