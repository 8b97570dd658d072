"""The weight endpoints, with SGLang's bodies and its ``{success, message}`` answers (HTTP 400 on
failure): ``WeightApi``.

``/init_weights_update_group`` joins a group, built as SGLang builds it (``weight_group``), in a
daemon thread; ``/update_weights_from_distributed`` receives a bucket by gloo or NCCL broadcast
from rank 0 in ``names`` order, or as SGLang's ``flattened_bucket``; ``/destroy_weights_update_group``
(``{group_name}``; as SGLang 0.5.23, HTTP 400 "The group to be destroyed does not exist." for a name
it holds no group of; the trainer calls it when it rebuilds its group); ``/update_weights_from_disk``
(an HF safetensors directory holding every weight); the LoRA endpoints ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/update_weight_version`` and adapter buckets of the distributed update
(one adapter, merged: ``lora.py``, docs/lora_sync.md). Bodies are read as SGLang's schemas read them
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
from .lora import Adapter, adapter_scale, check_adapter_tensors, pairs_complete, read_adapter_dir

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
            shapes = dict(zip(names, map(tuple, bucket.shapes)))
            lora = weight_requests.parse_adapter_bucket(body)
            if lora is None:
                self._refuse_full_update_over_adapter()
                check_weight_names(self.engine.forward.named_tensors(), shapes)
                load = None
            else:  # an adapter's tensors (the LoRA extension, docs/lora_sync.md)
                self._check_adapter(lora.lora_name, lora.config_dict, shapes, replace=True)
                load = self._adapter_load(lora.lora_name, lora.config_dict, "__distributed__", replace=False)
            received, tensors = weight_group.receive_buffers(
                [dtype_from_name(d, what="weight dtype") for d in bucket.dtypes], bucket.shapes,
                self.engine.forward.device, flattened=bucket.load_format == "flattened_bucket")
        except ValueError as exc:
            return _result(False, f"update_weights_from_distributed rejected: {type(exc).__name__}: {exc}")

        def receive() -> dict[str, torch.Tensor]:
            weight_group.broadcast_(group, received, src=0)
            return dict(zip(names, tensors))

        return await self._update(receive, version, bucket.abort_all_requests, load)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            version = fields.weight_version(body.get("weight_version"), self.engine.weight_version)
            abort_all = fields.field(body, "abort_all_requests", "bool", False)
            self._refuse_full_update_over_adapter()
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

    # ---- LoRA adapters (SGLang's endpoints; one adapter, merged: embedded/lora.py, docs/lora_sync.md) ----

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's ``/load_lora_adapter`` (``lora_name``, ``lora_path``: a peft directory), plus
        ``weight_version``: with it the adapter may replace one of the same name, and the version
        changes in the same swap; without it the version stays (SGLang's load carries none)."""
        body = await json_body(request)
        try:
            load = weight_requests.parse_load_adapter(body)
            version = fields.weight_version(load.weight_version, self.engine.weight_version)
            self._check_adapter(load.lora_name, None, {}, replace=load.weight_version is not None)
        except ValueError as exc:
            return _lora_answer(False, f"load_lora_adapter rejected: {exc}", self.engine)
        path, read = pathlib.Path(load.lora_path), {}

        def receive() -> dict[str, torch.Tensor]:
            config, tensors = read_adapter_dir(path)
            r = config.get("r")
            adapter_scale(config)  # a config the merge cannot serve is refused before the swap
            if not tensors:
                raise ValueError(f"{path} holds no adapter tensors")
            check_adapter_tensors(self.engine.forward.named_tensors(), {n: tuple(t.shape) for n, t in tensors.items()}, r)
            if not pairs_complete(tensors):
                raise ValueError(f"{path} holds a lora_A without its lora_B (or the reverse); write the whole adapter")
            read["config"] = config
            return tensors

        def merge(tensors: dict[str, torch.Tensor]) -> None:
            self._adapter_load(load.lora_name, read["config"], str(path), replace=True)(tensors)

        return await self._update(receive, version, False, merge, answer=self._lora_answer)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's ``/unload_lora_adapter`` (``lora_name``): the base weights come back; the
        weight version stays (as on SGLang)."""
        try:
            name = weight_requests.parse_unload_adapter(await json_body(request))
        except ValueError as exc:
            return _lora_answer(False, f"unload_lora_adapter rejected: {exc}", self.engine)
        held = self.engine.adapter
        if held is None or held.name != name:
            loaded = [held.name] if held is not None else []
            return _lora_answer(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}", self.engine)

        def unmerge(_: dict) -> None:
            if self.engine.adapter is not held:  # replaced or unloaded by a call that swapped first
                raise ValueError(f"LoRA adapter '{name}' changed while this unload waited; unload it again")
            held.restore(self.engine.forward.named_tensors())
            self.engine.adapter = None

        return await self._update(dict, self.engine.weight_version, False, unmerge, answer=self._lora_answer)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weight_version`` (``new_version``, ``abort_all_requests`` default
        true): the version changes between two steps, the weights stay."""
        try:
            raw, abort_all = weight_requests.parse_weight_version_update(await json_body(request))
            version = fields.weight_version(raw, self.engine.weight_version)
        except ValueError as exc:
            return _result(False, f"Failed to update weight version: {exc}")
        return await self._update(dict, version, abort_all, lambda _: None, new_version=str(version))

    def _lora_answer(self, ok: bool, message: str) -> web.Response:
        return _lora_answer(ok, None if ok else message, self.engine)

    def _check_adapter(self, name: str, config: dict | None, shapes: dict, replace: bool) -> None:
        """Raise ``ValueError`` for an adapter this server cannot take now: another one is held
        (one at a time), or this one is and ``replace`` is not asked; with ``config``, also a
        config or tensors the merge cannot serve."""
        held = self.engine.adapter
        if held is not None and held.name != name:
            raise ValueError(f"this server serves one LoRA adapter, merged into its weights, and holds '{held.name}'; "
                             f"unload it first (/unload_lora_adapter) or send lora_name '{held.name}'")
        if held is not None and not replace:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded; unload it first, or "
                             f"send weight_version to replace it in one swap")
        if config is not None:
            adapter_scale(config)
            check_adapter_tensors(self.engine.forward.named_tensors(), shapes, config["r"])

    def _adapter_load(self, name: str, config: dict, path: str, replace: bool):
        """The forward-thread load of adapter tensors: merged into the held adapter of ``name``
        (a bucket), or (``replace``, or none held) into a new one, the previous one unmerged first."""
        engine = self.engine

        def load(tensors: dict[str, torch.Tensor]) -> None:
            named = engine.forward.named_tensors()
            old = engine.adapter
            adapter = old
            if replace or old is None or old.name != name:
                if old is not None:
                    old.restore(named)
                adapter = Adapter(name, config, base=old.base if old is not None else None)
            adapter.path = path
            adapter.apply(named, tensors, config)
            engine.adapter = adapter

        return load

    def _refuse_full_update_over_adapter(self) -> None:
        held = self.engine.adapter
        if held is not None:
            raise ValueError(f"this server holds LoRA adapter '{held.name}' merged into its weights; a full-weight "
                             f"update would overwrite the merged weights: unload the adapter first")

    async def _update(self, receive, version: int, abort_all: bool, load=None, answer=None, **extra) -> web.Response:
        if answer is None:  # SGLang's weight answers, {success, message}; the LoRA ones: _lora_answer
            def answer(ok: bool, message: str) -> web.Response:
                return _result(ok, message, **extra)
        if abort_all:
            self.engine.abort(None)
        # its own task: a client that disconnects mid-update cancels only this handler, never a
        # swap half-done (tensors received but not loaded, or loaded under the old version)
        update = asyncio.ensure_future(self.engine.update_weights(receive, version, load))
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)
        if not await self._unless_closing(update):
            return _shutting_down("weight update")
        try:
            update.result()
        except (ValueError, RuntimeError) as exc:
            return answer(False, f"weight update failed: {type(exc).__name__}: {exc}")
        return answer(True, f"weights updated to version {self.engine.weight_version}")

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


def _lora_answer(success: bool, error: str | None, engine: Engine) -> web.Response:
    """SGLang's ``LoRAUpdateOutput``: ``{success, error_message, loaded_adapters}`` (HTTP 400 on
    failure), plus this server's ``weight_version``."""
    held = engine.adapter
    return web.json_response({"success": success, "error_message": error,
                              "loaded_adapters": {held.name: held.path} if held is not None else {},
                              "weight_version": str(engine.weight_version)}, status=200 if success else 400)


def _log_unanswered(work: asyncio.Future) -> None:
    """Log how a join or weight update ended after its client went away (nobody else reads it)."""
    if not work.cancelled() and work.exception() is not None:
        _log.warning("a weight-group call whose client went away failed: %s: %s",
                     type(work.exception()).__name__, work.exception())

