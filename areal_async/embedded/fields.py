"""The JSON field checker of the server's endpoints (SGLang's and the OpenAI ones): top-level fields.

``field`` checks exact JSON types (``true`` is not an integer, ``"false"`` not a boolean; missing
or ``null``: SGLang's default), ``per_prompt`` a field given once or once per prompt, ``rids`` and
``weight_version`` SGLang's ``rid`` and ``weight_version``. Errors are ``ValueError``s naming the
field, the value and what to send, which msgspec's do not (only ``sampling_params``, in
``request.py``, is a struct).
"""

from __future__ import annotations

import collections
import uuid

MAX_WEIGHT_VERSION = 2**63  # the first version refused: versions are int64 step counts

KINDS = {  # the JSON type a request field must have: (check, what to send)
    "bool": (lambda v: type(v) is bool, "a JSON boolean (true or false)"),
    "int": (lambda v: type(v) is int, "an integer"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "text": (lambda v: isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, str) for t in v)),
             "a string, or a non-empty list of strings (a batch)"),
}
REQUIRED = object()  # ``field``'s default for a field the request must carry


def field(body: dict, key: str, kind: str, default=REQUIRED, send: str | None = None):
    """``body[key]``, checked to be of ``kind`` (a key of ``KINDS``: exact JSON types, so ``true``
    is not an integer and ``"false"`` not a boolean); a missing or null field is ``default``.

    Raises:
        ValueError: the field is missing and has no default, or is of another type; the message
            names the value and what to send (``send``, else the kind's description).
    """
    value = body.get(key)
    if value is None and default is not REQUIRED:
        return default
    check, want = KINDS[kind]
    if key not in body:
        raise ValueError(f"{key} is missing; send {send or want}")
    if not check(value):
        raise ValueError(f"{key} {value!r} is not {want}; send {send or want}")
    return value


def per_prompt(body: dict, key: str, kind: str, default, n: int, batch: bool) -> list:
    """``body[key]`` for each of ``n`` prompts: one value (``kind``, see ``field``) for all, or, in a
    batch, a list of ``n`` such values (SGLang's ``BoolOrList`` / ``Int64OrList``); missing or null
    is ``default`` for all.

    Raises:
        ValueError: a value of another type, or a list of another length.
    """
    value = body.get(key)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{key} has {len(value)} values for a batch of {n} prompts; send one value "
                             f"for all, or one per prompt")
        return [field({key: v}, key, kind, default) for v in value]
    return [field(body, key, kind, default)] * n


def rids(raw, n: int, batch: bool) -> list[str]:
    """The request ids of ``n`` prompts: ``raw`` is SGLang's ``rid`` field, a string for one prompt,
    a list of ``n`` strings for a batch, or ``None`` (fresh ids).

    Raises:
        ValueError: any other shape or element type, an empty id, or one id given to two prompts.
    """
    if raw is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if not batch:
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"rid {raw!r} is not a non-empty string; send a string request id for one "
                             f"prompt (or leave rid out)")
        return [raw]
    if not isinstance(raw, list) or len(raw) != n or not all(isinstance(r, str) and r for r in raw):
        raise ValueError(f"rid {raw!r} is not a list of {n} non-empty strings; send a list of {n} string "
                         f"request ids, one per prompt (or leave rid out)")
    repeated = _first_repeated(raw)
    if repeated is not None:
        raise ValueError(f"rid {repeated!r} is given to {raw.count(repeated)} prompts of the batch; send "
                         f"a distinct request id for each prompt (or leave rid out)")
    return raw


def _first_repeated(items: list[str]) -> str | None:
    """The first item of ``items`` that appears more than once, or ``None``."""
    return next((item for item, count in collections.Counter(items).items() if count > 1), None)


def weight_version(raw, current: int) -> int:
    """SGLang's ``weight_version`` field as an int: ``None`` keeps ``current``; an int or its decimal
    string (``"3"``, the form SGLang's clients send) in ``[current, MAX_WEIGHT_VERSION)`` is the new
    version. ``current`` itself is allowed: every bucket of a distributed update carries the
    version, which the first bucket already set.

    Raises:
        ValueError: anything else (negative, fractional, a bool, a non-numeric string), a version
            behind ``current`` or one of ``MAX_WEIGHT_VERSION`` or more.
    """
    if raw is None:
        return current
    if type(raw) is int and raw >= 0:
        version = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit():
        version = int(raw)
    else:
        raise ValueError(f"weight_version {raw!r} is not a non-negative integer; send the policy version "
                         f'as a decimal string, e.g. "3" (or leave it out to keep version {current})')
    if version >= MAX_WEIGHT_VERSION:
        raise ValueError(f"weight_version {raw!r} is not below 2**63 (versions are int64); send the policy "
                         f"version, the trainer's step count (this server is at version {current})")
    if version < current:
        raise ValueError(f"weight_version {raw!r} is behind this server's current version {current}; a "
                         f"weight update never goes back: send a version >= {current}")
    return version


async def json_object(request, allow_empty: bool = False) -> dict:
    """``request``'s body (an ``aiohttp.web.Request``) as a JSON object; ``{}`` when it has no body
    and ``allow_empty`` (SGLang's bodiless calls, e.g. ``/pause_generation``).

    Raises:
        ValueError: the body is not JSON (nested too deep counts), or not an object.
    """
    if allow_empty and not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
        raise ValueError(f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    return data
