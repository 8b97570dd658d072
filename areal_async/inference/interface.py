"""The inference servers as their callers see them: ``GenerationClient`` (the generation worker
and the evaluator) and ``WeightUpdateClient`` (the trainer's ``WeightSender`` on rank 0).

``AdapterUpdateClient`` extends the latter for the LoRA sync (``trainer/lora_sync.py``).
``client.InferenceClient`` satisfies them all (what each call does is documented there, once); test
fakes implement only the one they stand in for; ``tests/test_interfaces.py`` checks them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from areal_async.inference.client import GenResult
    from areal_async.inference.routing import ServerPool

T = TypeVar("T")


@runtime_checkable
class GenerationClient(Protocol):
    """What ``rollout.worker.GenerationWorker`` and ``rollout.eval.evaluate`` call.

    Attributes:
        urls: one base URL per server; a caller picks server ``i`` in ``range(len(urls))``.
    """

    urls: list[str]

    async def generate(self, input_ids: list[int], sampling: dict, rid: str, server: int | None = None,
                       session: str | None = None) -> GenResult:
        """Once per sample (worker) or test prompt (evaluator): generate on ``server`` (or on the
        server of ``session``, an episode's key) until a stop token or ``max_new_tokens``,
        resubmitting across weight-update interruptions; the result carries each token's log-prob
        and policy version, and the prompt tokens the prefix cache served."""
        ...


@runtime_checkable
class WeightUpdateClient(Protocol):
    """What ``trainer.weight_sync``'s senders call on rank 0 (the servers' answers are unused).

    Attributes:
        urls: one base URL per server.
        servers: the routing state (``routing.ServerPool``): ``live()`` → the indices of the
            servers in routing; ``probe(require_version=...)`` lets dropped servers that answer
            again back in (both senders call it before each update); ``version(i)`` → server
            ``i``'s ``weight_version``, ``answers(i)`` → whether it answers ``/health``,
            ``take_out(i, why)``, ``route(0)`` (raises ``NoServerLeft`` when none is live): the
            distributed sender's checks when it rebuilds its group.
    """

    urls: list[str]
    servers: "ServerPool"

    async def each_live(self, call: "Callable[[int], Awaitable[T]]") -> "dict[int, T]":
        """``call(i)`` for every live server at once; a server that died during it is left out."""
        ...

    async def init_weights_update_group(self, server: int, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, backend: str, group_name: str) -> object:
        """Per server, at ``DistributedWeightSender.setup`` and at each rebuild of its group (a
        new ``group_name``, rank ``rank_offset`` of ``world_size``): join the trainer's weight group."""
        ...

    async def destroy_weights_update_group(self, server: int, group_name: str) -> object:
        """When ``DistributedWeightSender`` rebuilds its group (a server left or came back): on
        each server that joined the old group and is still live, destroy it."""
        ...

    async def update_weights_from_distributed(self, server: int, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], version: int, group_name: str) -> object:
        """Per bucket and server, while rank 0 broadcasts the bucket: receive it as ``version``."""
        ...

    async def update_weights_from_disk(self, server: int, path: str, version: int) -> object:
        """Per server, at ``DiskWeightSender.send``: load the HF directory ``path`` as ``version``."""
        ...

    async def pause(self, mode: str = "abort") -> None:
        """Before an update (``rollout.interrupt_on_update``): pause generation on every server."""
        ...

    async def continue_generation(self) -> None:
        """After an update, also a failed one: continue generation on every server."""
        ...


@runtime_checkable
class AdapterUpdateClient(WeightUpdateClient, Protocol):
    """What ``trainer/lora_sync.py``'s adapter senders call on rank 0 (docs/lora_sync.md): the
    weight-update calls, an adapter bucket's extension fields, and SGLang's LoRA endpoints."""

    async def update_weights_from_distributed(self, server: int, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], version: int, group_name: str,
                                              adapter: "tuple[str, dict] | None" = None) -> object:
        """Per bucket and server: receive it as ``version``; ``adapter``: ``(lora_name,
        adapter_config)`` when the tensors are a LoRA adapter's (``DistributedAdapterSender``)."""
        ...

    async def load_lora_adapter(self, server: int, name: str, path: str, version: int | None = None) -> object:
        """Per server, at ``DiskAdapterSender.send``: load the peft directory ``path`` as ``name``
        (``version``: the embedded server's one-swap replacement)."""
        ...

    async def unload_lora_adapter(self, server: int, name: str) -> object:
        """Per server, before an SGLang server loads the next version under the same name."""
        ...

    async def update_weight_version(self, server: int, version: int) -> object:
        """Per server, after an SGLang server loaded the adapter: set its ``weight_version``."""
        ...
