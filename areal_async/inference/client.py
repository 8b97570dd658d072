"""``InferenceClient``: the async HTTP client for SGLang-compatible servers (embedded or real SGLang).

Only SGLang's request fields are sent (docs/sglang_api.md), so the same code drives both backends.
``generate`` is AReaL's interruptible generation: a response that comes back ``abort`` because the
servers paused for a weight update is resubmitted as ``input_ids + output so far`` with the
remaining ``max_new_tokens`` and the same ``sampling_seed``; each segment's tokens carry that
response's ``weight_version``, and its ``output_token_logprobs`` must pair one to one with its
``output_ids`` (else ``LogprobAlignmentError``). Only ``abort(rid)`` ends a generation ``"abort"``.
Retries: at the network boundary only (``_call``). A server that dies: its generations go on at
the next live one (``routing.py``; docs/faults.md#an-inference-server-dies-or-hangs). ``token`` is
sent as ``Authorization: Bearer <token>``, SGLang's ``--api-key`` scheme.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import msgspec

from .. import auth
from .routing import NoServerLeft, ServerPool

T = TypeVar("T")
__all__ = ["GenResult", "InferenceClient", "LogprobAlignmentError", "NoServerLeft", "ServerError"]


def _segment_logprobs(url: str, rid: str, version: int, ids: list[int], entries: list,
                      offset: int) -> list[float]:
    """The log-probs of one response's ``output_ids``, from SGLang's ``output_token_logprobs``
    (``[[logprob, token_id, text], ...]``, one per output token), checked against the ids.

    Args:
        ids: ``[L]`` the response's ``output_ids`` (one segment of a resubmitted generation).
        entries: its ``meta_info.output_token_logprobs``.
        offset: the number of tokens generated before this segment (positions in errors count
            from the start of the whole output).
    Returns:
        ``[L]`` float log-probs, entry j belonging to ``ids[j]``.
    Raises:
        LogprobAlignmentError: a count that differs from ``len(ids)``, or an entry whose token id
            is not the output id at its position (sglang#20799; paired anyway they would crash
            the trainer on a tensor size or train on another token's log-prob).
        ServerError: a log-prob that is not a finite number (broken weights:
            docs/faults.md#an-inference-server-dies-or-hangs).
    """
    for j in range(max(len(ids), len(entries))):
        want = ids[j] if j < len(ids) else None
        got = entries[j][1] if j < len(entries) else None
        if want != got or isinstance(got, bool):
            raise LogprobAlignmentError(url, rid, offset + j, want, got, len(ids), len(entries), version)
    logprobs = [entry[0] for entry in entries]
    bad = [x for x in logprobs if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)]
    if bad:
        raise ServerError(url, 200, f"rid {rid!r} came back with {len(bad)} log-prob(s) that are not finite "
                                    f"numbers (first: {bad[0]!r}) under weight version {version}: those "
                                    f"weights are broken (e.g. a diverged update); load good weights")
    return [float(x) for x in logprobs]


def _delay_s(retry_after: str | None, default_s: float) -> float:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds, or an HTTP date), at most 60;
    ``default_s`` when it is absent or unreadable."""
    if retry_after is None:
        return default_s
    try:
        delay_s = float(retry_after)
    except ValueError:
        try:
            delay_s = email.utils.parsedate_to_datetime(retry_after).timestamp() - time.time()
        except (TypeError, ValueError):
            return default_s
    return min(max(delay_s, 0.0), 60.0) if math.isfinite(delay_s) else default_s


class GenResult(msgspec.Struct):
    """One finished generation.

    Fields:
        output_ids: ``[L]`` generated token ids (stop token included when one matched).
        logprobs: ``[L]`` log-probs of each token under the sampled (temperature-scaled) distribution.
        versions: ``[L]`` the server's ``weight_version`` when each token's segment was returned.
        finish_reason: ``stop`` | ``length`` | ``abort`` (only when the caller aborted it).
        prompt_tokens: the prompt tokens of its requests (``meta_info.prompt_tokens``), summed over
            the segments of a resubmitted generation.
        cached_tokens: of those, the ones the servers' prefix caches served (``meta_info.cached_tokens``);
            ``cached_tokens / prompt_tokens`` is its prefix-cache hit rate.
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0


class ServerError(RuntimeError):
    """An inference server answered with an HTTP error; carries the URL, status and message."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class LogprobAlignmentError(ServerError):
    """A response's ``output_token_logprobs`` do not pair one to one with its ``output_ids``.

    Carries ``rid``, ``position`` (counted from the start of the whole output, across
    resubmissions), ``output_id`` and ``logprob_token_id`` (``None`` where one list ran out).
    """

    def __init__(self, url: str, rid: str, position: int, output_id: int | None,
                 logprob_token_id: int | None, n_ids: int, n_entries: int, version: int):
        self.rid, self.position = rid, position
        self.output_id, self.logprob_token_id = output_id, logprob_token_id
        super().__init__(url, 200, (
            f"rid {rid!r}: output_token_logprobs do not match output_ids at output position "
            f"{position}: output id {output_id}, log-prob entry's token id {logprob_token_id} "
            f"({n_entries} log-prob entries for {n_ids} output ids in this response, weight "
            f"version {version}); a server bug (e.g. sglang#20799, speculative decoding with "
            f"max_new_tokens): run without the feature that causes it or upgrade the server"))


def _version(url: str, raw) -> int:
    """Parse SGLang's string ``weight_version``; a non-integer (SGLang's default is "default") is an error."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ServerError(url, 200, f"weight_version {raw!r} is not an integer; start SGLang with "
                                    "--weight-version 0 (a version that reports it in meta_info)") from None


LORA_NAME = "policy"  # the one adapter name a LoRA job's servers load every version under


def job_lora_path(backend: str, lora_rank: int) -> str | None:
    """The ``lora_path`` every ``/generate`` of a job names: ``LORA_NAME`` for a LoRA job
    (``lora_rank > 0``) on ``"sglang"``, which serves the base model to a request naming no adapter;
    ``None`` otherwise (the embedded engine serves its merged adapter to every request)."""
    return LORA_NAME if lora_rank > 0 and backend == "sglang" else None


class InferenceClient:
    """Async client for one or more servers (``urls``: e.g. ``["http://127.0.0.1:30000"]``).

    Args:
        urls: server base URLs; methods taking ``server`` use its index in this list.
        timeout_s: per-HTTP-call timeout in seconds (a generation can take minutes).
        max_retries: retries of a call that failed to connect.
        backoff_s: first retry delay, doubled each retry.
        token: the job's token (``auth.job_token()``), sent as a bearer token; ``None``: none sent.
        overload_timeout_s: how long a call refused with HTTP 503 (a full server queue) keeps
            asking again, counted from its first attempt; ``None``: ``timeout_s``.
        probe_timeout_s, reprobe_interval_s: of the failover's probes of servers (``routing.py``),
            seconds.
        health_check_interval_s: while a generation waits, its server is asked
            ``/health_generate`` this often (seconds; the same timeout); one that does not answer
            leaves routing and the generation goes on elsewhere. ``None``: no such check.
        max_pause_s: a server that says it is paused (``GET /ready`` 503) counts as alive for this
            many seconds in a row (``routing.Readiness``).
        rejoin_timeout_s: when every server is out of routing, how long a call waits for one to
            rejoin (``ServerPool.wait_live``) before it raises ``NoServerLeft``, seconds; 0: at once.
    """

    def __init__(self, urls: list[str], timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 0.5,
                 token: str | None = None, overload_timeout_s: float | None = None,
                 probe_timeout_s: float = 5.0, reprobe_interval_s: float = 2.0,
                 health_check_interval_s: float | None = None, max_pause_s: float = 300.0,
                 rejoin_timeout_s: float = 0.0, lora_path: str | None = None):
        if not urls:
            raise ValueError("InferenceClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.overload_timeout_s = timeout_s if overload_timeout_s is None else overload_timeout_s
        self.refusals = 0  # HTTP 503 answers (full server queues) retried so far, all calls together
        self._http_pool: aiohttp.ClientSession | None = None
        self._next_server = itertools.cycle(range(len(self.urls)))
        self._aborted: set[str] = set()
        self._headers = auth.bearer_headers(token)
        self.servers = ServerPool(self.urls, self._http, probe_timeout_s, reprobe_interval_s,
                                  health_check_interval_s, max_pause_s, rejoin_timeout_s)
        self._versions: dict[int, int] = {}  # the last weight_version each server answered with
        # the LoRA adapter every /generate names (SGLang's lora_path; None: the base model);
        # docs/lora_sync.md
        self.lora_path = lora_path

    @property
    def server_failures(self) -> int:
        """Servers taken out of routing so far (each departure once)."""
        return self.servers.failures

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.servers.close()
        if self._http_pool is not None:
            await self._http_pool.close()
            self._http_pool = None

    def _http(self) -> aiohttp.ClientSession:
        if self._http_pool is None:  # created lazily: an aiohttp ClientSession is bound to the running loop
            self._http_pool = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # concurrency is bounded by the caller
                headers=self._headers,
            )
        return self._http_pool

    async def _call(self, server: int, method: str, path: str, payload: dict | None = None,
                    failover: bool = False):
        """One HTTP call, retried at the network boundary only. A connection error (server not up
        yet, connection reset) is retried ``max_retries`` times, after ``backoff_s`` doubling; with
        ``failover`` only while the server still answers ``GET /ready`` (any status), else the server
        leaves routing and the error is raised. HTTP 503 from a full server queue (``admission.py``;
        SGLang's refusal of ``/generate`` carries no ``Retry-After``) is asked again after
        ``Retry-After`` (without it: the backoff, doubling up to 16x), spread by up to 25 % so refused
        callers do not all return at once, until ``overload_timeout_s`` has passed since the first
        attempt: a refused request never entered the queue, so the same rid and seed are safe.

        Raises:
            ServerError: any other HTTP error, at once (401: the job's token is missing or wrong,
                ``areal_async/auth.py``), or a 503 still refused after ``overload_timeout_s``.
        """
        url = self.urls[server] + path
        started = time.monotonic()
        failures = refusals = 0
        while True:
            try:
                async with self._http().request(method, url, json=payload) as resp:
                    text = await resp.text()
                    status, retry_after, kind = resp.status, resp.headers.get("Retry-After"), resp.content_type
            except aiohttp.ClientConnectionError as exc:
                if failover and not await self.servers.alive(server):
                    self.servers.take_out(server, f"{path}: {type(exc).__name__}: {exc}")
                    raise
                if failures == self.max_retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2**failures)
                failures += 1
                continue
            if status == 503 and (retry_after is not None or path == "/generate"):
                # the server's waiting queue is full: the request was not queued, ask again later
                wait_s = _delay_s(retry_after, self.backoff_s * 2**min(refusals, 4)) * (1 + 0.25 * random.random())
                waited_s = time.monotonic() - started
                if waited_s + wait_s > self.overload_timeout_s:
                    raise ServerError(url, status, f"{text} (refused {refusals + 1} time(s) in {waited_s:.1f} s; "
                                                   f"gave up after overload_timeout_s {self.overload_timeout_s:g}: "
                                                   f"send fewer requests at once or add servers)")
                refusals += 1
                self.refusals += 1
                await asyncio.sleep(wait_s)
                continue
            if status != 200:
                raise ServerError(url, status, text)
            return msgspec.json.decode(text) if kind == "application/json" else text

    async def each_live(self, call: Callable[[int], Awaitable[T]]) -> dict[int, T]:
        """``call(i)`` for every live server ``i`` at once; returns ``{i: result}`` of those still
        live after it. A server whose call failed to connect and that no longer answers
        ``GET /ready`` is taken out of routing and left out (a weight sender skips a dead server).

        When no server is live (before the calls, or after them: every one died meanwhile), it
        waits for one to rejoin (``ServerPool.wait_live``) and calls that one.

        Raises:
            NoServerLeft: no server rejoined within ``rejoin_timeout_s``.
            Exception: any other error of a call (the first one, in server order).
        """
        while True:
            await self.servers.wait_live()  # NoServerLeft once none rejoined in rejoin_timeout_s
            servers = self.servers.live()
            assert servers, "wait_live returned with no server live"
            results = await asyncio.gather(*(call(i) for i in servers), return_exceptions=True)
            out = {}
            for i, result in zip(servers, results):
                if isinstance(result, aiohttp.ClientConnectionError) and i not in self.servers.live():
                    continue  # taken out by _call(failover=True)
                if isinstance(result, aiohttp.ClientConnectionError) and not await self.servers.alive(i):
                    self.servers.take_out(i, f"{type(result).__name__}: {result}")
                    continue
                if isinstance(result, BaseException):
                    raise result
                out[i] = result
            if out:
                return out
            # every server died during the calls: once one rejoins, it is called

    async def _all(self, method: str, path: str, payload: dict | None = None) -> list:
        return list((await self.each_live(lambda i: self._call(i, method, path, payload, failover=True))).values())

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health``; raises ``ConnectionError`` naming the first
        URL that did not come up within ``timeout_s`` seconds. Then a server behind the highest
        ``weight_version`` of them (one restarted with the initial weights) stays out of routing
        until it serves the current weights (``routing.py``; not counted as a failure)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for url in self.urls:
            while True:
                try:
                    async with self._http().get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        if resp.status == 200:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                if loop.time() >= deadline:
                    raise ConnectionError(f"inference server {url} did not become healthy within {timeout_s:.0f} s")
                await asyncio.sleep(0.2)
        if len(self.urls) > 1:
            versions = await asyncio.gather(*(self.servers.version(i) for i in range(len(self.urls))))
            current = max((v for v in versions if v is not None), default=0)
            for i, v in enumerate(versions):
                if v is not None and v < current:
                    self.servers.take_out(i, f"serves weight version {v}, behind version {current}", failed=False)

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: dict, rid: str, server: int | None = None,
                       session: str | None = None) -> GenResult:
        """Generate until stop/length, resubmitting across weight-update aborts (module docstring).

        Args:
            input_ids: prompt token ids.
            sampling: SGLang ``sampling_params`` (``max_new_tokens``, ``temperature``, ``sampling_seed``…).
            rid: request id (also what ``abort(rid)`` names).
            server: index into ``urls``; round-robin when ``None``. While it is out of routing,
                the next live one (``routing.py``).
            session: a key (e.g. an episode id) whose calls all go to one server while it is live
                (``ServerPool.route_session``: its prefix cache then holds the earlier turns), each
                segment routed afresh, so a resubmission after a death goes to the session's next
                server; exclusive with ``server``; ``None``: routed by ``server`` as above.
        Raises:
            ValueError: both ``server`` and ``session`` given.
            NoServerLeft: every server was taken out of routing and none rejoined within
                ``rejoin_timeout_s``.
            ServerError: the server rejected the request (e.g. HTTP 400 for a too-long prompt),
                answered with log-probs that are not finite numbers, or still refused it with HTTP
                503 (full queue) after ``overload_timeout_s``.
            LogprobAlignmentError: a response's ``output_token_logprobs`` differ in count from its
                ``output_ids`` or carry another token id at some position (names the rid, the
                server, the position and both ids). Never retried: the same request gets the
                same answer.
        """
        if server is not None and session is not None:
            raise ValueError(f"generate got server={server} and session={session!r}: a session picks its own "
                             f"server; give one of them")
        # a session call leaves the round-robin where it was: calls without a key route as before
        preferred = server if server is not None or session is not None else next(self._next_server)
        remaining = int(sampling.get("max_new_tokens", 128))
        at_least = int(sampling.get("min_new_tokens") or 0)
        out = GenResult([], [], [], "length")
        while True:
            # a resubmission owes what is left of both budgets (else min_new_tokens could exceed
            # the remaining max_new_tokens, a 400)
            owed = {"min_new_tokens": max(0, at_least - len(out.output_ids))} if at_least else {}
            payload = {
                "input_ids": list(input_ids) + out.output_ids,
                "sampling_params": {**sampling, "max_new_tokens": remaining, **owed},
                "return_logprob": True,
                "rid": rid,
            }
            if self.lora_path is not None:
                payload["lora_path"] = self.lora_path
            await self.servers.wait_live()  # every server out: wait up to rejoin_timeout_s for one
            server = self.servers.route(preferred) if session is None else self.servers.route_session(session)
            try:
                call = asyncio.ensure_future(self._call(server, "POST", "/generate", payload, failover=True))
                resp = await self.servers.watch(server, call)
            except aiohttp.ClientConnectionError:
                if server in self.servers.live():
                    raise  # it still answers /ready: not a dead server, retries used up
                continue  # resubmitted to the next live server: same rid, seed, output so far
            meta = resp["meta_info"]
            ids = list(resp["output_ids"])
            version = _version(self.urls[server], meta.get("weight_version"))
            if version < self._versions.get(server, version):  # a new process: restarted behind our back
                self.servers.take_out(server, f"restarted: weight version {version} after "
                                              f"{self._versions[server]}")
                del self._versions[server]
                continue  # this segment came from old weights: generated again on the next live server
            self._versions[server] = version
            # checked per response, so a resubmission's segment pairs with its own tokens only
            out.logprobs += _segment_logprobs(self.urls[server], rid, version, ids,
                                              meta.get("output_token_logprobs", []), len(out.output_ids))
            out.output_ids += ids
            out.versions += [version] * len(ids)
            out.prompt_tokens += int(meta.get("prompt_tokens") or 0)
            out.cached_tokens += int(meta.get("cached_tokens") or 0)
            remaining -= len(ids)
            reason = meta["finish_reason"]["type"]
            if reason != "abort":
                out.finish_reason = reason
                return out
            if rid in self._aborted:
                self._aborted.discard(rid)
                out.finish_reason = "abort"
                return out
            if remaining <= 0:
                return out

    async def abort(self, rid: str) -> None:
        """Abort request ``rid`` on every server; its ``generate`` returns with ``"abort"``."""
        self._aborted.add(rid)
        await self._all("POST", "/abort_request", {"rid": rid})

    # ---- flow control (all servers, concurrently) -----------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation on every server (in-flight requests return as ``abort`` and are resubmitted)."""
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """After ``pause``: continue generation on every live server (SGLang's ``/continue_generation``)."""
        await self._all("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache")

    # ---- info -----------------------------------------------------------------------------------

    async def get_weight_version(self, server: int, failover: bool = False) -> int:
        """``server``'s weight version (``failover``: as ``_call``'s)."""
        raw = (await self._call(server, "GET", "/get_weight_version", failover=failover))["weight_version"]
        return _version(self.urls[server], raw)

    async def weight_versions(self) -> dict[int, int]:
        """``{i: weight_version}`` of every live server (``each_live``: a dead one is left out)."""
        return await self.each_live(lambda i: self.get_weight_version(i, failover=True))

    async def get_model_info(self, server: int) -> dict:
        return await self._call(server, "GET", "/get_model_info")

    # ---- weights --------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        server: int,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
    ) -> dict:
        """Ask ``server`` to join the trainer's weight group (returns once every rank joined). A
        server that fails to connect and no longer answers ``GET /ready`` leaves routing (as
        ``update_weights_from_distributed`` and ``destroy_weights_update_group``)."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "backend": backend,
            "group_name": group_name,
        }
        return await self._call(server, "POST", "/init_weights_update_group", payload, failover=True)

    async def destroy_weights_update_group(self, server: int, group_name: str = "weight_update_group") -> dict:
        """Ask ``server`` to leave and destroy its weight group ``group_name`` (SGLang's
        ``/destroy_weights_update_group``, ``{success, message}``).

        Raises:
            ServerError: HTTP 400 when the server holds no group of that name (SGLang's message:
                "The group to be destroyed does not exist.", e.g. a restarted server).
        """
        return await self._call(server, "POST", "/destroy_weights_update_group", {"group_name": group_name},
                                failover=True)

    async def update_weights_from_distributed(
        self,
        server: int,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
        adapter: tuple[str, dict] | None = None,
    ) -> dict:
        """Announce one bucket of tensors that rank 0 broadcasts in ``names`` order; ``version`` is
        sent as SGLang's string ``weight_version``. ``adapter``: ``(lora_name, adapter_config)``
        of a LoRA adapter whose tensors these are (the embedded server's extension fields
        ``lora_name`` and ``config_dict``, docs/lora_sync.md; SGLang has no such update)."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        if adapter is not None:
            payload["lora_name"], payload["config_dict"] = adapter
        return await self._call(server, "POST", "/update_weights_from_distributed", payload, failover=True)

    async def update_weights_from_disk(self, server: int, path: str, version: int) -> dict:
        """Load an HF safetensors directory on ``server`` and set ``weight_version``."""
        payload = {"model_path": str(path), "weight_version": str(version)}
        return await self._call(server, "POST", "/update_weights_from_disk", payload)

    # ---- LoRA adapters (SGLang's endpoints; docs/lora_sync.md) ------------------------------------

    async def load_lora_adapter(self, server: int, name: str, path: str, version: int | None = None) -> dict:
        """Load the peft adapter directory ``path`` as ``name`` on ``server`` (SGLang's
        ``/load_lora_adapter``). ``version``: the embedded server's extension ``weight_version``:
        the adapter replaces one of the same name and the version changes in the same swap (SGLang
        refuses a loaded name: unload first, then ``update_weight_version``)."""
        payload = {"lora_name": name, "lora_path": str(path)}
        if version is not None:
            payload["weight_version"] = str(version)
        return await self._call(server, "POST", "/load_lora_adapter", payload)

    async def unload_lora_adapter(self, server: int, name: str) -> dict:
        """Unload adapter ``name`` on ``server`` (SGLang's ``/unload_lora_adapter``).

        Raises:
            ServerError: HTTP 400 when no adapter of that name is loaded (e.g. a restarted server).
        """
        return await self._call(server, "POST", "/unload_lora_adapter", {"lora_name": name})

    async def update_weight_version(self, server: int, version: int) -> dict:
        """Set ``server``'s ``weight_version`` without touching its weights (SGLang's
        ``/update_weight_version``; requests in flight go on: ``abort_all_requests`` false)."""
        return await self._call(server, "POST", "/update_weight_version",
                                {"new_version": str(version), "abort_all_requests": False})
