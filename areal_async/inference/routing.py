"""``ServerPool``: which inference servers a client routes to, and how a dead one leaves and rejoins.

``route``: the preferred server while live, else the next live one in index order, so the choice
depends on which servers are out, never on timing. ``route_session``: a session's server (an
episode's calls, so its next turn finds its earlier turns' keys and values in that server's prefix
cache), by rendezvous hashing (Thaler & Ravishankar 1998): the live server with the highest
``session_score(key, index)``, a function of the key and the live set only; a departure moves only
the sessions it served, each to its next-highest live server, and a rejoin moves them back. A server leaves (``take_out``; ``failures``
counts departures) when a call lost its connection and a short ``GET /ready`` gets no answer
either, or when it fails the check a waiting call runs every ``health_check_interval_s``
(``watch``); a paused one counts as alive for ``max_pause_s``, one whose engine died fails at once
(``Readiness``). A background ``probe`` takes back one that answers ``GET /health_generate`` at the
current weight version; with none live, calls wait ``rejoin_timeout_s`` (``wait_live``), then raise
``NoServerLeft``. The rules, and what they miss: docs/faults.md#an-inference-server-dies-or-hangs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable

import aiohttp


def session_score(key: str, server: int) -> int:
    """Rendezvous-hashing weight of ``server`` (an index) for session ``key``: the first 8 bytes of
    BLAKE2b over both, so every process and run maps a key alike (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{server}".encode(), digest_size=8).digest(), "big")


class NoServerLeft(ConnectionError):
    """Every inference server of a client was taken out of routing; the message names each one
    and why it left."""


# How the embedded server's error message for a dead engine begins (``embedded/engine/engine.py``,
# ``Engine.run``; pinned by tests/test_server_health.py); read here over HTTP only, as the layout rules ask.
ENGINE_FAILED = "inference engine failed"


def engine_failure(body: bytes) -> str | None:
    """The message of a ``GET /ready`` 503 body that names a dead engine (the embedded server's
    ``{"error": {"message": "inference engine failed: ..."}}``, ``embedded/errors.py``), else
    ``None``: SGLang's empty body (paused, unhealthy or starting alike), or any other body."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, TypeError, KeyError):  # empty, not JSON, or not that shape
        return None
    return message if isinstance(message, str) and message.startswith(ENGINE_FAILED) else None


class Readiness:
    """What a server's ``GET /ready`` says before its generation check, per server (a paused
    server is not a hung one: docs/faults.md#an-inference-server-dies-or-hangs); used by the
    clients (``ServerPool.watch``) and the launcher. A 503 whose body names a dead engine
    (``engine_failure``) fails at once; any other 503 counts as a pause (SGLang's has an empty body
    whether the server is paused, unhealthy or starting, so those stay alike).

    Args:
        max_pause_s: seconds in a row a server may answer 503 (paused) and still count as alive.
    """

    def __init__(self, max_pause_s: float):
        self.max_pause_s = max_pause_s
        self._since: dict = {}  # server -> when it first said it was paused, this pause

    def judge(self, server, status: int | None, now: float, body: bytes = b"") -> bool | str:
        """``status``: the HTTP status of ``GET /ready`` (``None``: no answer), ``now``:
        ``time.monotonic()``, ``body``: the answer's body. Returns ``True`` when the server is
        paused and still counts as alive (skip the generation check), ``False`` when the generation
        check is due, or why the server failed (no answer, a dead engine, or paused for longer than
        ``max_pause_s``)."""
        if status is None:
            self._since.pop(server, None)
            return "no answer to /ready"
        if status != 503:  # 200, or 404 from a server without /ready
            self._since.pop(server, None)
            return False
        dead = engine_failure(body)
        if dead is not None:  # not a pause: the engine serves nothing more until restarted
            self._since.pop(server, None)
            return f"GET /ready 503: {dead}"
        paused_s = now - self._since.setdefault(server, now)
        if paused_s > self.max_pause_s:
            return (f"paused (GET /ready 503) for {paused_s:.0f} s, longer than inference.max_pause_s = "
                    f"{self.max_pause_s:g} s")
        return True


class ServerPool:
    """The live subset of ``urls`` (indices), for one ``InferenceClient``.

    Args:
        urls: server base URLs (index ``i`` is server ``i``).
        http: returns the client's ``aiohttp.ClientSession`` (created lazily on the running loop).
        probe_timeout_s: timeout of each probe (``/ready``, ``/health_generate``,
            ``/get_weight_version``), seconds.
        reprobe_interval_s: least time between two background probes of departed servers, seconds.
        health_check_interval_s: how often a server a call waits on is asked ``/health_generate``
            (``watch``), seconds; ``None``: never.
        rejoin_timeout_s: how long ``wait_live`` waits for a departed server to rejoin when none is
            live, seconds; 0: not at all.
        max_pause_s: ``Readiness``'s bound, seconds.
    """

    def __init__(self, urls: list[str], http: Callable[[], aiohttp.ClientSession],
                 probe_timeout_s: float = 5.0, reprobe_interval_s: float = 2.0,
                 health_check_interval_s: float | None = None, max_pause_s: float = 300.0,
                 rejoin_timeout_s: float = 0.0):
        self.urls, self._http = urls, http
        self.readiness = Readiness(max_pause_s)
        self.probe_timeout_s, self.reprobe_interval_s = probe_timeout_s, reprobe_interval_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self._checks: dict[int, asyncio.Task] = {}  # a /health_generate check in flight, per server
        self.failures = 0  # servers taken out of routing so far
        self._down: dict[int, str] = {}  # departed server -> why it left
        self._probing: asyncio.Task | None = None
        self._last_probe = -float("inf")

    def live(self) -> list[int]:
        """Indices of the servers in routing, ascending."""
        return [i for i in range(len(self.urls)) if i not in self._down]

    def route(self, preferred: int) -> int:
        """``preferred`` if it is live, else the next live index after it (cyclically); starts a
        background probe of the departed servers when one is due.

        Raises:
            NoServerLeft: no server is live (an async caller first waits, ``wait_live``).
        """
        if self._down:
            self._maybe_probe()
        n = len(self.urls)
        for j in range(n):
            if (preferred + j) % n not in self._down:
                return (preferred + j) % n
        raise self._none_left()

    def route_session(self, key: str) -> int:
        """Session ``key``'s server: the live index with the highest ``session_score`` (module
        docstring); starts a background probe of the departed servers when one is due.

        Raises:
            NoServerLeft: no server is live (an async caller first waits, ``wait_live``).
        """
        if self._down:
            self._maybe_probe()
        live = self.live()
        if not live:
            raise self._none_left()
        return max(live, key=lambda i: session_score(key, i))

    async def wait_live(self) -> None:
        """Return once some server is live. While none is, the departed ones are probed every
        ``reprobe_interval_s`` (``route``'s background probe), for up to ``rejoin_timeout_s``.

        Raises:
            NoServerLeft: none rejoined within ``rejoin_timeout_s`` (names each server and why it
                left, and the wait).
        """
        if self.live():
            return
        deadline = time.monotonic() + self.rejoin_timeout_s
        while not self.live():
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise self._none_left(f"; none rejoined within inference.server_rejoin_timeout_s="
                                      f"{self.rejoin_timeout_s:g} s" if self.rejoin_timeout_s > 0 else "")
            self._maybe_probe()
            if self._probing is not None and not self._probing.done():
                await asyncio.wait([self._probing], timeout=left_s)  # its result is what we wait for
            else:  # probed less than reprobe_interval_s ago: wait until the next one is due
                due_s = self._last_probe + self.reprobe_interval_s - time.monotonic()
                await asyncio.sleep(max(0.0, min(left_s, due_s)))

    def _none_left(self, more: str = "") -> NoServerLeft:
        reasons = "; ".join(f"{self.urls[i]}: {why}" for i, why in sorted(self._down.items()))
        return NoServerLeft(f"no inference server left: all {len(self.urls)} were taken out of routing "
                            f"({reasons}){more}; see the servers' logs (RUN_DIR/logs/server*.log)")

    def take_out(self, server: int, why: str, failed: bool = True) -> None:
        """Remove ``server`` from routing; ``failed``: count it as a failure (once per departure;
        not for a server found behind the current weights at start, ``InferenceClient.wait_healthy``)."""
        if server in self._down:
            return
        self._down[server] = why
        self.failures += int(failed)
        print(f"[client] inference server {self.urls[server]} taken out of routing ({why}); "
              f"{len(self.live())} of {len(self.urls)} left", flush=True)

    async def watch(self, server: int, call: asyncio.Future):
        """``call``'s result (a call to ``server``); while it waits, ``server`` is health-checked
        every ``health_check_interval_s`` (module docstring; ``None``: never).

        Raises:
            aiohttp.ServerTimeoutError: ``server`` failed a check: it left routing, ``call`` was
                cancelled.
            Exception: what ``call`` raised.
        """
        interval_s = self.health_check_interval_s
        try:
            while interval_s is not None and not (await asyncio.wait([call], timeout=interval_s))[0]:
                check = self._checks.get(server)
                if check is None or check.done():  # one check per server for all its calls
                    check = self._checks[server] = asyncio.ensure_future(self.healthy(server, interval_s))
                why = await asyncio.shield(check)
                if why is not None and not call.done():
                    self.take_out(server, why)
                    raise aiohttp.ServerTimeoutError(f"{self.urls[server]} failed its health check")
            return await call
        finally:
            if not call.done():
                call.cancel()

    async def healthy(self, server: int, timeout_s: float) -> str | None:
        """``None`` when ``server`` is alive: paused (``Readiness``) or it answered ``GET
        /health_generate`` with 200 within ``timeout_s`` seconds; else why not."""
        status, body = await self.answer(server, "/ready", min(timeout_s, self.probe_timeout_s))
        paused = self.readiness.judge(server, status, time.monotonic(), body)
        if paused is True:
            return None
        if paused is not False:
            return paused
        if await self.answers(server, "/health_generate", timeout_s=timeout_s):
            return None
        return f"no answer to /health_generate within {timeout_s:g} s"

    async def answer(self, server: int, path: str, timeout_s: float) -> tuple[int | None, bytes]:
        """The HTTP status and body of ``GET path`` on ``server`` within ``timeout_s`` seconds,
        ``(None, b"")`` without an answer."""
        try:
            async with self._http().get(self.urls[server] + path,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None, b""

    async def status(self, server: int, path: str, timeout_s: float) -> int | None:
        """The HTTP status of ``GET path`` on ``server`` within ``timeout_s`` seconds, ``None``
        without an answer."""
        return (await self.answer(server, path, timeout_s))[0]

    async def alive(self, server: int) -> bool:
        """Whether ``server``'s HTTP layer answers ``GET /ready`` at all (any status) within
        ``probe_timeout_s``: the process is up. Not ``/health``: SGLang's runs a generation, which
        waits behind a pause (docs/sglang_api.md#flow-control)."""
        return await self.status(server, "/ready", self.probe_timeout_s) is not None

    async def answers(self, server: int, path: str = "/health", timeout_s: float | None = None) -> bool:
        """Whether ``server`` answers ``GET path`` with 200 within ``timeout_s`` seconds
        (``None``: ``probe_timeout_s``)."""
        return await self.status(server, path, self.probe_timeout_s if timeout_s is None else timeout_s) == 200

    async def version(self, server: int) -> int | None:
        """``server``'s ``weight_version`` as an int, ``None`` when it does not answer with one."""
        try:
            async with self._http().get(self.urls[server] + "/get_weight_version",
                                        timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                if resp.status != 200:
                    return None
                return int((await resp.json(content_type=None))["weight_version"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, KeyError):
            return None

    async def probe(self, require_version: bool = True) -> list[int]:
        """Ask every departed server again (module docstring); returns the ones that rejoined.
        ``require_version``: only one serving the highest version a live server reports."""
        self._last_probe = time.monotonic()
        down = sorted(self._down)
        if not down:
            return []
        healthy = await asyncio.gather(*(self.answers(i, "/health_generate") for i in down))
        back = [i for i, ok in zip(down, healthy) if ok]
        if back and require_version:
            live = [v for v in await asyncio.gather(*(self.version(i) for i in self.live())) if v is not None]
            current = max(live, default=0)
            versions = await asyncio.gather(*(self.version(i) for i in back))
            back = [i for i, v in zip(back, versions) if v is not None and v >= current]
        for i in back:
            if self._down.pop(i, None) is not None:
                print(f"[client] inference server {self.urls[i]} is back in routing", flush=True)
        return back

    def _maybe_probe(self) -> None:
        if self._probing is not None and not self._probing.done():
            return
        if time.monotonic() - self._last_probe < self.reprobe_interval_s:
            return
        self._last_probe = time.monotonic()
        self._probing = asyncio.get_running_loop().create_task(self.probe(), name="reprobe-servers")

    async def close(self) -> None:
        """Cancel a background probe still running."""
        for check in self._checks.values():
            check.cancel()
        self._checks.clear()
        if self._probing is not None and not self._probing.done():
            self._probing.cancel()
            try:
                await self._probing
            except (asyncio.CancelledError, Exception):
                pass
        self._probing = None
