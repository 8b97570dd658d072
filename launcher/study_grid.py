"""A study's ``--grid`` axes: any config key over a list of values, beside η, objective and seed.

``--grid trainer.lr=1e-6,1e-5`` is one axis. Its key is checked against the config schema and
each value parsed as the key's type by the config's own loading (``load_config``: an unknown key
names the closest valid one, a bad value the rule); values are split at commas outside brackets
and quotes (``--grid trainer.adam_betas=[0.9,0.99],[0.9,0.999]``, ``--grid KEY='"a, b",c'``). An
axis's values are stored typed, as JSON builtins (``1e-6`` and ``0.000001`` are one value, given
twice). A grid point is one value of each axis, ``{key: value}``, in the order the axes were given.

A cell's name adds ``-<short><value>`` per axis (``-lr1e-06-max_new_tokens256``): ``short`` is the
key's last part, or the whole dotted key where two axes share a last part; the value in the
portable file-name set ``[A-Za-z0-9._-]`` (floats by ``repr``, booleans ``true``/``false``), each
run of other characters replaced by ``_`` (none at the ends), and a 6-hex digest of the value
added where that makes two values of an axis alike or the text is over ``VALUE_CHARS``. A name
over ``NAME_CHARS`` (``fit_name``) is cut and ends with a digest of the whole grid point.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re

import msgspec

from areal_async.config import load_config

VALUE_CHARS = 40  # longer value texts are cut to 32 characters and a digest
NAME_CHARS = 240  # a cell's name cut to this: it and its console file <name>.out fit a file name (255 bytes)
TAG_CHARS = 64  # wandb refuses a longer tag (wandb.init raises), so a long value's tag is cut


@dataclasses.dataclass(frozen=True)
class Axis:
    """One ``--grid KEY=V1,V2,...``: the dotted config key and its values (typed JSON builtins)."""

    key: str
    values: tuple

    def record(self) -> dict:
        """The axis in ``study.json``: ``{"key": ..., "values": [...]}``."""
        return {"key": self.key, "values": list(self.values)}


def split_values(text: str) -> list[str]:
    """``"1,[2,3],x"`` → ``["1", "[2,3]", "x"]``: commas inside brackets, braces or a YAML-quoted
    string (``"a, b"``, ``'a, b'``: a quote that opens a value or a flow item) do not split."""
    items, depth, start, quote, prev, i = [], 0, 0, "", ",", 0
    while i < len(text):
        ch = text[i]
        if quote == '"' and ch == "\\":
            i += 1  # an escaped character
        elif quote and ch == quote:
            if quote == "'" and text[i + 1:i + 2] == "'":
                i += 1  # '' is a quote inside a single-quoted string
            else:
                quote = ""
        elif not quote and ch in "\"'" and prev in ",[{:":
            quote = ch
        elif not quote:
            depth = max(depth + (ch in "[{") - (ch in "]}"), 0)
            if ch == "," and depth == 0:
                items.append(text[start:i].strip())
                start = i + 1
        if not ch.isspace():
            prev = ch
        i += 1
    return items + [text[start:].strip()]


def config_value(cfg, key: str):
    """The value of dotted ``key`` in a loaded config, as JSON builtins (tuples → lists)."""
    return msgspec.to_builtins(functools.reduce(getattr, key.split("."), cfg))


def parse_axis(text: str, config: str, overrides: list[str], reserved: dict[str, str]) -> Axis:
    """``"KEY=V1,V2"`` → ``Axis``, each value loaded into the config with ``overrides``.

    ``reserved``: keys the study sets itself → the flag to give instead. Raises ``ValueError``
    naming the text and the fix: no ``=``, an empty value, a reserved key or one set by a plain
    override, an unknown key (with the closest valid name), a value the key refuses, a value given
    twice.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ValueError(f"--grid {text}: give one config key and its values, comma-separated, e.g. "
                         f"--grid trainer.lr=1e-6,1e-5")
    if key in reserved:
        raise ValueError(f"--grid {text}: the study sets {key} for each cell; {reserved[key]}")
    given = {o.partition("=")[0].strip() for o in overrides}
    if key in given:
        raise ValueError(f"--grid {text}: {key} is also set by the override {key}=...; a key is either varied "
                         f"(--grid) or fixed (an override): drop one of them")
    values = []
    for item in split_values(raw):
        if not item:
            raise ValueError(f"--grid {text}: an empty value; give each value of {key} once, comma-separated")
        try:
            cfg = load_config(config, [*overrides, f"{key}={item}"])
        except ValueError as exc:
            raise ValueError(f"--grid {text}: {exc}") from None
        value = config_value(cfg, key)
        if isinstance(value, dict):
            raise ValueError(f"--grid {text}: {key} is a mapping; vary one of its entries, --grid {key}.NAME=...")
        if value in values:
            raise ValueError(f"--grid {text}: {item!r} is {json.dumps(value)}, given twice; give each value once")
        values.append(value)
    return Axis(key, tuple(values))


def parse_grid(texts: list[str], config: str, overrides: list[str], reserved: dict[str, str]) -> list[Axis]:
    """The ``--grid`` flags as axes (``parse_axis``), in the order given; a key given twice is a
    ``ValueError``. Every grid point is loaded too, so a combination the config refuses (e.g.
    too many new tokens for ``inference.max_seq_len``) fails here, before any cell runs."""
    axes: list[Axis] = []
    for text in texts:
        axis = parse_axis(text, config, overrides, reserved)
        if any(a.key == axis.key for a in axes):
            raise ValueError(f"--grid {text}: {axis.key} is given in two --grid flags; give all its values in one")
        axes.append(axis)
    if len(axes) > 1:
        for point in points(axes):
            try:
                load_config(config, [*overrides, *point_overrides(point)])
            except ValueError as exc:
                raise ValueError(f"--grid point {point_text(point)}: {exc}") from None
    return axes


def points(axes: list[Axis]) -> list[dict]:
    """Every grid point, ``{key: value}``, the last axis varying fastest; ``[{}]`` without axes."""
    return [dict(zip([a.key for a in axes], combo)) for combo in itertools.product(*[a.values for a in axes])]


def point_overrides(point: dict) -> list[str]:
    """``["trainer.lr=1e-06", ...]``: a grid point as config overrides (values as JSON, which YAML reads)."""
    return [f"{key}={json.dumps(value)}" for key, value in point.items()]


def point_text(point: dict) -> str:
    """``"trainer.lr=1e-06, rollout.max_new_tokens=256"``."""
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in point.items())


def point_tags(point: dict) -> list[str]:
    """wandb tags of a grid point: ``["trainer.lr=1e-06", ...]``, each cut to ``TAG_CHARS``
    (the run's config holds the whole value)."""
    return [f"{key}={json.dumps(value)}"[:TAG_CHARS] for key, value in point.items()]


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key's last part, or the whole dotted key where two keys share their last part."""
    leaves = [k.rpartition(".")[2] for k in keys]
    return {k: leaf if leaves.count(leaf) == 1 else k for k, leaf in zip(keys, leaves)}


def _digest(value) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:6]


def _plain_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def value_texts(axis: Axis) -> list[str]:
    """The file-name-safe text of each value of ``axis`` (module docstring), distinct within it."""
    safe = [re.sub(r"[^A-Za-z0-9._-]+", "_", _plain_text(v)).strip("_") or "_" for v in axis.values]
    out = []
    for value, text in zip(axis.values, safe):
        if len(text) > VALUE_CHARS:
            text = f"{text[:32]}-{_digest(value)}"
        elif safe.count(text) > 1:
            text = f"{text}-{_digest(value)}"
        out.append(text)
    return out


def name_suffix(point: dict, axes: list[Axis]) -> str:
    """``"-lr1e-06-max_new_tokens256"`` for a point of ``axes``; ``""`` without axes."""
    short = short_keys([a.key for a in axes])
    return "".join(f"-{short[a.key]}{value_texts(a)[a.values.index(point[a.key])]}" for a in axes)


def fit_name(name: str, point: dict) -> str:
    """``name``, or where it is over ``NAME_CHARS``, its first ``NAME_CHARS - 7`` characters and
    ``-<6-hex digest of point>``."""
    return name if len(name) <= NAME_CHARS else f"{name[:NAME_CHARS - 7]}-{_digest(point)}"
