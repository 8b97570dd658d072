"""The weight endpoints, with SGLang's bodies and its ``{success, message}`` answers (HTTP 400 on
failure): ``WeightApi``.

``/init_weights_update_group`` joins a group, built as SGLang builds it (``weight_group``), in a
daemon thread; ``/update_weights_from_distributed`` receives a bucket by gloo or NCCL broadcast
from rank 0 in ``names`` order, or as SGLang's ``flattened_bucket``; ``/destroy_weights_update_group``
(``{group_name}``; as SGLang 0.5.23, HTTP 400 "The group to be destroyed does not exist." for a name
it holds no group of; the trainer calls it when it rebuilds its group); ``/update_weights_from_disk``
(an HF safetensors directory holding every weight). Bodies are read as SGLang's schemas read them
(``weight_requests.py``: ``"29612"`` as a port; a missing ``group_name`` is ``"weight_update_group"``).
``weight_version`` is an integer below 2**63 (SGLang sends ``"3"``) that never goes back: a version
behind the server's is refused before any tensor is read or received (the current one is accepted:
each bucket of a distributed update carries it).

An update of a server that is not paused waits as SGLang's does (its model-update lock): requests
unfinished when it arrives end under the old weights, those arriving meanwhile run under the new
ones; a paused server swaps at once (``Engine.update_weights``). An update runs in its own task, so
a client that disconnects never leaves one half-applied; once the server shuts down
(``begin_shutdown``), a join still waiting for peers, or a receive still blocked, is answered 503
and abandoned in its daemon thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pathlib

import torch
from aiohttp import web
from safetensors.torch import load_file

from .. import weight_group
from ..dtypes import dtype_from_name
from . import fields
from . import weight_requests
from .engine.engine import Engine
from .engine.forward import check_weight_names
from .errors import json_body

_log = logging.getLogger(__name__)


def _result(success: bool, message: str, **extra) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def _shutting_down(what: str) -> web.Response:
    return web.json_response({"success": False, "message": f"{what} abandoned: the server is shutting down"},
                             status=503)


class WeightApi:
    """The weight handlers over ``engine``; holds the weight groups joined and the updates in flight."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.groups: dict = {}
        self._closing = asyncio.Event()  # set when the server starts shutting down
        self._updates: set[asyncio.Task] = set()  # weight updates in flight (the loop holds tasks weakly)

    def begin_shutdown(self) -> None:
        """The server is shutting down: a join waiting for peers, or an update, gives up."""
        self._closing.set()

    async def close(self) -> None:
        """Cancel the updates their handlers abandoned at shutdown and destroy every group."""
        for update in list(self._updates):
            update.cancel()
        await asyncio.gather(*self._updates, return_exceptions=True)
        while self.groups:  # their names are the process's (torch's registry): free them for a next server
            weight_group.destroy_weight_group(self.groups.popitem()[1])

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            join = weight_requests.parse_join(await json_body(request))
        except ValueError as exc:
            return _result(False, f"init_weights_update_group failed: ValueError: {exc}")
        old = self.groups.pop(join.group_name, None)
        if old is not None:  # a trainer joining again (it restarted): the old group has no sender left
            weight_group.destroy_weight_group(old)
        joining = weight_group.in_daemon_thread(functools.partial(
            weight_group.new_weight_group, join.backend, join.master_address, join.master_port, join.rank_offset,
            join.world_size, group_name=join.group_name))
        if not await self._unless_closing(joining):
            return _shutting_down("init_weights_update_group")
        try:
            group = joining.result()
        except (ValueError, RuntimeError) as exc:  # torch's DistError (a peer never came) is a RuntimeError
            message = f"init_weights_update_group failed: {type(exc).__name__}: {exc}"
            _log.warning("%s", message)
            return _result(False, message)
        self.groups[join.group_name] = group
        return _result(True, f"joined weight group '{join.group_name}'")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        # SGLang 0.5.23's answers: 200 {success: true}, or 400 {success: false} naming why
        try:
            name = weight_requests.parse_destroy(await json_body(request))
        except ValueError as exc:
            return _result(False, f"destroy_weights_update_group failed: ValueError: {exc}")
        group = self.groups.pop(name, None)
        if group is None:
            return _result(False, "The group to be destroyed does not exist.")
        # a receive still blocked in it keeps it alive until the trainer's side closes (weight_group)
        weight_group.destroy_weight_group(group)
        return _result(True, f"destroyed weight group '{name}'")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            bucket = weight_requests.parse_bucket(body)
            version = fields.weight_version(bucket.weight_version, self.engine.weight_version)
            # flush_cache is read but not obeyed: every weight update flushes the prefix cache (stale
            # keys and values are never right)
            group = self.groups.get(bucket.group_name)
            if group is None:
                joined = ", ".join(f"'{g}'" for g in self.groups) or "none yet"
                raise ValueError(f"no weight group '{bucket.group_name}' (joined: {joined}); call "
                                 f"/init_weights_update_group with group_name '{bucket.group_name}' first, or "
                                 f"send the group_name of a joined group")
            names = bucket.names
            check_weight_names(self.engine.forward.named_tensors(), dict(zip(names, map(tuple, bucket.shapes))))
            received, tensors = weight_group.receive_buffers(
                [dtype_from_name(d, what="weight dtype") for d in bucket.dtypes], bucket.shapes,
                self.engine.forward.device, flattened=bucket.load_format == "flattened_bucket")
        except ValueError as exc:
            return _result(False, f"update_weights_from_distributed rejected: {type(exc).__name__}: {exc}")

        def receive() -> dict[str, torch.Tensor]:
            weight_group.broadcast_(group, received, src=0)
            return dict(zip(names, tensors))

        return await self._update(receive, version, bucket.abort_all_requests)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            version = fields.weight_version(body.get("weight_version"), self.engine.weight_version)
            abort_all = fields.field(body, "abort_all_requests", "bool", False)
        except ValueError as exc:
            return _result(False, f"update_weights_from_disk rejected: {exc}", num_paused_requests=0)
        raw = body.get("model_path")
        if not isinstance(raw, str) or not raw:
            return _result(False, f"model_path {raw!r} is not a directory path; send the HF directory holding the "
                                  f"*.safetensors weights", num_paused_requests=0)
        path = pathlib.Path(raw)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return _result(False, f"model_path '{path}' has no *.safetensors files", num_paused_requests=0)

        def receive() -> dict[str, torch.Tensor]:
            tensors: dict[str, torch.Tensor] = {}
            for f in files:
                try:
                    tensors.update(load_file(str(f)))
                except Exception as exc:  # safetensors raises its own SafetensorError (header, truncation)
                    raise ValueError(f"{f} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                                     f"write the directory again") from exc
            expected = {name for name, _ in self.engine.forward.model.named_parameters()}  # tied ones once
            missing = sorted(expected - tensors.keys())
            if missing:
                raise ValueError(f"{path} holds {len(expected) - len(missing)} of the model's {len(expected)} "
                                 f"weights (missing {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                 f"a weight update from disk replaces every weight: write the whole model")
            return tensors

        return await self._update(receive, version, abort_all, num_paused_requests=0)

    async def _update(self, receive, version: int, abort_all: bool, **extra) -> web.Response:
        if abort_all:
            self.engine.abort(None)
        # its own task: a client that disconnects mid-update cancels only this handler, never a
        # swap half-done (tensors received but not loaded, or loaded under the old version)
        update = asyncio.ensure_future(self.engine.update_weights(receive, version))
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)
        if not await self._unless_closing(update):
            return _shutting_down("weight update")
        try:
            update.result()
        except (ValueError, RuntimeError) as exc:
            return _result(False, f"weight update failed: {type(exc).__name__}: {exc}", **extra)
        return _result(True, f"weights updated to version {self.engine.weight_version}", **extra)

    async def _unless_closing(self, work: asyncio.Future) -> bool:
        """Wait for ``work`` unless the server starts shutting down first: then cancel it (a join
        or a receive still blocked in its daemon thread is abandoned) and return ``False``. A
        cancelled caller (the client went away) does not cancel ``work``: a weight swap is never
        left half-done."""
        closing = asyncio.ensure_future(self._closing.wait())
        try:  # unlike wait_for, asyncio.wait leaves ``work`` running when this caller is cancelled
            await asyncio.wait([work, closing], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.add_done_callback(_log_unanswered)  # its outcome is read once, by the log
            raise
        finally:
            closing.cancel()
        if work.done():
            return True
        work.cancel()
        return False


def _log_unanswered(work: asyncio.Future) -> None:
    """Log how a join or weight update ended after its client went away (nobody else reads it)."""
    if not work.cancelled() and work.exception() is not None:
        _log.warning("a weight-group call whose client went away failed: %s: %s",
                     type(work.exception()).__name__, work.exception())

