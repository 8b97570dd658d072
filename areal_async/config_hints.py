"""The hints in a config error: what was given, the choices of a ``Literal``, how to quote a number
for a ``str`` key, what to give instead of YAML null, the rule for a non-finite float, what
replaced a renamed key (``RENAMED``, ``renamed_hint``).

Pure functions of the raw config ``data`` (nested dicts, as read from YAML and the overrides), a
dotted ``key`` and the root config type; ``config.load_config`` and ``config.from_dict`` build
their ``ValueError``s from them.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any, Literal

import msgspec


def is_non_finite(value: Any) -> bool:
    """Whether ``value`` is a float, or text msgspec reads as one (``nan``, ``-inf``), that is inf or NaN."""
    try:
        return isinstance(value, (float, str)) and not math.isfinite(float(value))
    except ValueError:
        return False


def finite_rule(key: str, value: float) -> str:
    return f"{key}={value}: must be a finite number"


def null_hint(root: type, data: dict, key: str) -> str:
    """What to give instead of YAML null (``key=`` with nothing after ``=``); empty otherwise."""
    field = _field(root, key)
    if lookup(data, key) is not None or field is None:
        return ""
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if default == "":
        return f"; nothing after '=' is YAML null: give text, or '{key}=\"\"' for an empty string"
    kind, example = ("a non-empty string", default) if isinstance(default, str) else ("a value", json.dumps(default))
    return f"; nothing after '=' is YAML null: {key} must be {kind}, e.g. {key}={example}"


def quote_hint(data: dict, key: str, msg: str) -> str:
    """How to give a number or boolean as the text a ``str`` key wants (YAML reads ``name=123`` as
    the int 123); empty for other errors."""
    value = lookup(data, key)
    if not msg.startswith("Expected `str`") or not isinstance(value, (bool, int, float)):
        return ""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    kind = "a boolean" if isinstance(value, bool) else "a number"
    return (f"; YAML reads {text} as {kind}, so quote it: '{key}=\"{text}\"' on the command line, "
            f"{key.rpartition('.')[2]}: \"{text}\" in the YAML file")


# a key that was replaced → (the key that replaced it, {old value: new value}); refused with
# ``renamed_hint``, never read as the new key
RENAMED: dict[str, tuple[str, dict]] = {
    "algo.decoupled": ("algo.objective", {True: "decoupled", False: "naive"}),
}


def renamed_hint(key: str, flag: str = "") -> str:
    """What to give instead of the replaced dotted ``key`` (a key of ``RENAMED``), as an override of
    the key that replaced it, or as ``flag`` (a command-line flag that sets that key) if given."""
    new, values = RENAMED[key]
    short = key.rpartition(".")[2]
    given = (lambda v: f"{flag} {v}") if flag else (lambda v: f"{new}={v}")
    pairs = ", ".join(f"{short}: {json.dumps(old)} → {given(value)}" for old, value in values.items())
    both = f", both: {flag} {','.join(map(str, values.values()))}" if flag and len(values) > 1 else ""
    return f"give {flag or new} instead ({pairs}{both})"

MISSING = object()


def lookup(data: dict, key: str) -> Any:
    """The value given for dotted ``key`` in ``data``, or ``MISSING``."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def given(data: dict, key: str) -> str:
    """`` = <value>`` as given for dotted ``key`` in ``data`` (empty if it cannot be looked up)."""
    value = lookup(data, key)
    return "" if value is MISSING else f" = {value!r}"


def _field(root: type, key: str) -> msgspec.structs.FieldInfo | None:
    """The config field at dotted ``key`` (``None`` if there is none, e.g. an index into a list)."""
    tp, field = root, None
    for part in key.split("."):
        fields = {f.name: f for f in msgspec.structs.fields(tp)} if isinstance(tp, type) and issubclass(
            tp, msgspec.Struct) else {}
        if part not in fields:
            return None
        field = fields[part]
        tp = field.type
    return field


def choices(root: type, key: str) -> str:
    """``; choose one of [...]`` when the field at dotted ``key`` is a ``Literal``."""
    field = _field(root, key)
    if field is None or typing.get_origin(field.type) is not Literal:
        return ""
    return f"; choose one of {list(typing.get_args(field.type))}"
