"""The bodies of ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group``, read as SGLang 0.5.23's lax pydantic schemas read them.

Scalars are coerced as pydantic's lax mode does (``lax_int``, ``lax_bool``;
docs/sglang_api.md#weights), but a JSON boolean is not an integer here. ``load_format`` is absent
or ``"flattened_bucket"`` (``LOAD_FORMATS``), any other refused before the broadcast. Bad input is
a ``ValueError`` naming the field, the value and what to send.
"""

from __future__ import annotations

import re

import msgspec

from ..weight_group import DEFAULT_GROUP_NAME

_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")  # pydantic's integer string, once stripped
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # pydantic's boolean strings, any case
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_MISSING = object()
LOAD_FORMATS = (None, "flattened_bucket")


class JoinRequest(msgspec.Struct, frozen=True):
    """``/init_weights_update_group``: join ``group_name`` as rank ``rank_offset`` of ``world_size``."""

    master_address: str
    master_port: int  # [1, 65535]
    rank_offset: int  # >= 1: rank 0 is the trainer, the broadcast source
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class BucketRequest(msgspec.Struct, frozen=True):
    """``/update_weights_from_distributed``: receive ``names`` (one dtype and shape each) from rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: object = None  # read by the server against its current version
    load_format: str | None = None


def lax_int(key: str, value) -> int:
    """``value`` as pydantic's lax ``int`` reads it (docs/sglang_api.md#weights).

    Raises:
        ValueError: a bool, a fractional or non-finite number, a non-numeric string, or another type.
    """
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT.fullmatch(value.strip()):
        return int(value.strip().partition(".")[0])  # the fraction is zeros
    raise ValueError(f"{key} {value!r} is not an integer; send an integer, e.g. 29612 (or its decimal "
                     f"string, \"29612\")")


def lax_bool(key: str, value) -> bool:
    """``value`` as pydantic's lax ``bool`` reads it (docs/sglang_api.md#weights).

    Raises:
        ValueError: any other number, string or type.
    """
    if type(value) is bool:
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError(f"{key} {value!r} is not a boolean; send true or false")


def _get(body: dict, key: str, default=_MISSING):
    """``body[key]``; ``default`` (SGLang's) when absent or null. SGLang refuses a null for a field
    that is not ``Optional``; here it means "absent" where a default exists, as for every other
    field of this server, and is refused (by the field's reader) where none does."""
    if body.get(key) is not None:
        return body[key]
    if default is not _MISSING:
        return default
    if key not in body:
        raise ValueError(f"{key} is missing; send it (SGLang's schema requires it)")
    return None


def _text(key: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} {value!r} is not a non-empty string; send a non-empty string")
    return value


def _texts(key: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{key} {value!r} is not a list of non-empty strings; send one string per tensor")
    return value


def _shapes(value) -> list[list[int]]:
    send = "send one shape per tensor, each a list of integers >= 0"
    if not isinstance(value, list) or not all(isinstance(s, list) for s in value):
        raise ValueError(f"shapes {value!r} is not a list of shapes; {send}")
    try:
        shapes = [[lax_int("shapes", d) for d in s] for s in value]
    except ValueError:
        raise ValueError(f"shapes {value!r} is not a list of shapes; {send}") from None
    if any(d < 0 for s in shapes for d in s):
        raise ValueError(f"shapes {value!r} is not a list of shapes: a dimension is negative; {send}")
    return shapes


def parse_join(body: dict) -> JoinRequest:
    """The ``/init_weights_update_group`` body as a ``JoinRequest``.

    Raises:
        ValueError: a field missing or of another type, a port outside [1, 65535], rank_offset < 1.
    """
    raw = _get(body, "master_port")
    try:
        port = lax_int("master_port", raw)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"master_port {raw!r} is not a port number in [1, 65535]; send the port the "
                         f"trainer's rank 0 listens on (an integer or its decimal string)")
    rank_offset = lax_int("rank_offset", _get(body, "rank_offset"))
    if rank_offset < 1:
        raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer, the broadcast source), got {rank_offset}")
    return JoinRequest(
        master_address=_text("master_address", _get(body, "master_address")),
        master_port=port,
        rank_offset=rank_offset,
        world_size=lax_int("world_size", _get(body, "world_size")),
        group_name=_text("group_name", _get(body, "group_name", DEFAULT_GROUP_NAME)),
        backend=_text("backend", _get(body, "backend", "nccl")),
    )


def parse_bucket(body: dict) -> BucketRequest:
    """The ``/update_weights_from_distributed`` body as a ``BucketRequest`` (``weight_version``
    unread: the server checks it against its own version).

    Raises:
        ValueError: a field missing or of another type, lists of different lengths, a name listed
            twice, or a ``load_format`` other than SGLang's two.
    """
    names, dtypes = _texts("names", _get(body, "names")), _texts("dtypes", _get(body, "dtypes"))
    shapes = _shapes(_get(body, "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}; "
                         f"send one dtype and one shape per name")
    repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if repeated is not None:  # two broadcasts into one weight: which one lands is arbitrary
        raise ValueError(f"names lists {repeated!r} more than once; send each weight once per bucket")
    load_format = _get(body, "load_format", None)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; send none (one broadcast per "
                         f"tensor) or 'flattened_bucket' (one broadcast of the bucket's bytes)")
    return BucketRequest(
        names=names, dtypes=dtypes, shapes=shapes,
        group_name=_text("group_name", _get(body, "group_name", DEFAULT_GROUP_NAME)),
        flush_cache=lax_bool("flush_cache", _get(body, "flush_cache", True)),
        abort_all_requests=lax_bool("abort_all_requests", _get(body, "abort_all_requests", False)),
        weight_version=body.get("weight_version"),
        load_format=load_format,
    )


def parse_destroy(body: dict) -> str:
    """The ``/destroy_weights_update_group`` body's ``group_name`` (SGLang's default when absent).

    Raises:
        ValueError: a ``group_name`` that is not a non-empty string.
    """
    return _text("group_name", _get(body, "group_name", DEFAULT_GROUP_NAME))


# ---- LoRA adapters (docs/lora_sync.md) ----------------------------------------------------------

class LoadAdapterRequest(msgspec.Struct, frozen=True):
    """``/load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``): load the peft directory
    ``lora_path`` as ``lora_name``. ``weight_version`` is this project's extension (SGLang's load
    carries none): when given, the adapter replaces one of the same name and the version changes
    in the same swap."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    weight_version: object = None  # read by the server against its current version


class AdapterBucket(msgspec.Struct, frozen=True):
    """The LoRA extension of ``/update_weights_from_distributed``: the bucket's tensors are adapter
    ``lora_name``'s (peft names), with its ``config_dict`` (field names of SGLang's
    ``LoadLoRAAdapterFromTensorsReqInput``)."""

    lora_name: str
    config_dict: dict


def parse_load_adapter(body: dict) -> LoadAdapterRequest:
    """The ``/load_lora_adapter`` body.

    Raises:
        ValueError: ``lora_name`` or ``lora_path`` missing or not a non-empty string, ``pinned``
            not a boolean.
    """
    return LoadAdapterRequest(
        lora_name=_text("lora_name", _get(body, "lora_name")),
        lora_path=_text("lora_path", _get(body, "lora_path")),
        pinned=lax_bool("pinned", _get(body, "pinned", False)),
        weight_version=body.get("weight_version"),
    )


def parse_unload_adapter(body: dict) -> str:
    """The ``/unload_lora_adapter`` body's ``lora_name``.

    Raises:
        ValueError: ``lora_name`` missing or not a non-empty string.
    """
    return _text("lora_name", _get(body, "lora_name"))


def parse_weight_version_update(body: dict) -> tuple[object, bool]:
    """The ``/update_weight_version`` body (SGLang's ``UpdateWeightVersionReqInput``):
    ``(new_version, abort_all_requests)``; ``new_version`` unread (the server checks it).

    Raises:
        ValueError: ``new_version`` missing, ``abort_all_requests`` not a boolean.
    """
    return _get(body, "new_version"), lax_bool("abort_all_requests", _get(body, "abort_all_requests", True))


def parse_adapter_bucket(body: dict) -> AdapterBucket | None:
    """The LoRA extension fields of an ``/update_weights_from_distributed`` body, or ``None`` when
    it has none (a full-weight bucket).

    Raises:
        ValueError: ``lora_name`` without a ``config_dict`` object, or the reverse.
    """
    name, config = body.get("lora_name"), body.get("config_dict")
    if name is None and config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"config_dict {config!r} is not an object; an adapter bucket sends lora_name and its peft "
                         f"adapter_config.json as config_dict")
    return AdapterBucket(lora_name=_text("lora_name", name), config_dict=config)
