"""Rows from local JSONL or Parquet files, checked at load, and the ``file`` task built on them.

``read_items(path, parse, what)``: a ``.parquet`` file is read with pyarrow (rows counted from 1,
``x.parquet row 3``); any other name is JSONL, one JSON object a line (``x.jsonl:3``; blank lines
are not rows; a UTF-8 byte order mark opening the file is skipped). Each row becomes a ``TaskItem`` through ``parse``. Anything wrong with a row (not
UTF-8, not JSON, not an object, a missing or mistyped field) is a ``ValueError`` ``"{source}:
malformed {what}: {why}"`` naming the field and the fix; no row is dropped or repaired.

Rows of the ``file`` task (``parse_row``; the keys are ``DataConfig``'s): exactly one of
``prompt_key`` (a non-empty string, one user turn; or a list of messages, TRL's and verl's
conversational form) and ``messages_key`` (a list of messages); a message is an object with
string ``role`` and ``content``, the last one not the assistant's. ``answer_key``: a non-empty
string or a number (read as its decimal text); ``""``: rows have no answer (``""`` is passed). A
dotted key (``reward_model.ground_truth``) reaches into nested objects when no field has that
exact name. A null counts as absent. The row itself stays in ``TaskItem.row``, untouched.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

from areal_async.config import DataConfig
from areal_async.data.task import ChatTask, TaskItem, resolve_data_path

RowParser = Callable[[dict, str], TaskItem]
"""``parse(row, source) -> TaskItem``; raises ``ValueError`` saying what is wrong with the row."""

_MISSING = object()


def read_items(path: str | pathlib.Path, parse: RowParser, what: str = "row") -> list[TaskItem]:
    """Every row of ``path`` parsed into a ``TaskItem``, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row (``"{source}: malformed {what}: {why}"``), or a Parquet file
            that pyarrow cannot read.
    """
    path = pathlib.Path(path)
    items = []
    for source, raw in _raw_rows(path):
        try:
            items.append(parse(_decode(raw) if isinstance(raw, bytes) else raw, source))
        except ValueError as exc:
            raise ValueError(f"{source}: malformed {what}: {exc}") from None
    return items


def _raw_rows(path: pathlib.Path) -> Iterator[tuple[str, bytes | dict]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{path} is not a Parquet file pyarrow can read ({exc})") from None
        for n, row in enumerate(rows, start=1):
            yield f"{path} row {n}", row
        return
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
            if line.strip():
                yield f"{path}:{lineno}", line


def _decode(line: bytes) -> dict:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object (one row per line), got {_kind(row)}")
    return row


def parse_row(row: dict, cfg: DataConfig) -> tuple[list[dict[str, Any]], str]:
    """The prompt turns and the answer of one row of the ``file`` task (rules: module docstring).

    Raises:
        ValueError: what is wrong, naming the field and the key that names it.
    """
    prompt, messages = _present(row, cfg.prompt_key), _present(row, cfg.messages_key)
    if prompt is None and messages is None:
        raise ValueError(f"no '{cfg.prompt_key}' or '{cfg.messages_key}' field ({_fields(row)}); "
                         f"name the field holding your prompt with data.prompt_key (a string or "
                         f"messages) or data.messages_key")
    if prompt is not None and messages is not None:
        raise ValueError(f"both '{cfg.prompt_key}' and '{cfg.messages_key}' are set; a row has "
                         f"one of them")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"field '{cfg.prompt_key}' is empty")
        turns = [{"role": "user", "content": prompt}]
    elif prompt is not None and not isinstance(prompt, list):
        raise ValueError(f"field '{cfg.prompt_key}' is {_kind(prompt)}, not a string or a list of "
                         f"messages")
    else:
        key = cfg.prompt_key if prompt is not None else cfg.messages_key
        turns = _check_messages(prompt if prompt is not None else messages, key)
        if cfg.system_prompt and turns[0]["role"] == "system":
            raise ValueError(f"field '{key}' starts with a system message and data.system_prompt is "
                             f"set too; keep one of them")
    return turns, _answer(row, cfg.answer_key)


def _check_messages(value: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"field '{key}' is {_kind(value)}, not a non-empty list of messages "
                         f"({{\"role\": ..., \"content\": ...}} objects)")
    for k, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            raise ValueError(f"field '{key}', message {k} is {_kind(m)}, not an object with "
                             f"'role' and 'content'")
        for part in ("role", "content"):
            if not isinstance(m.get(part), str):
                raise ValueError(f"field '{key}', message {k}: '{part}' is "
                                 f"{_kind(m.get(part, _MISSING))}, not a string")
    if value[-1]["role"] == "assistant":
        raise ValueError(f"field '{key}': the last message is the assistant's; a prompt ends with "
                         f"the turn the model answers")
    return value


def _answer(row: dict, key: str) -> str:
    if not key:
        return ""
    value = _get(row, key)
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if value is _MISSING:
        raise ValueError(f"no '{key}' field ({_fields(row)}); name the field holding the answer "
                         f"with data.answer_key, or set data.answer_key='' if your rows have none")
    raise ValueError(f"field '{key}' is {_kind(value)}; the answer must be a non-empty string or a "
                     f"number (other fields reach reward functions that take `item`)")


def _get(row: dict, key: str) -> Any:
    """``row[key]``, else the dotted path ``a.b`` through nested objects; ``_MISSING`` if absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _present(row: dict, key: str) -> Any:
    """``_get``, with a null read as absent (``None``)."""
    value = _get(row, key)
    return None if value is _MISSING else value


def _kind(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "an empty string" if not value.strip() else "a string"
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


def _fields(row: dict) -> str:
    names = sorted(map(str, row))
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    return f"the row's fields: {shown}" if names else "the row has no fields"


def load_file(cfg: DataConfig, split: str) -> ChatTask:
    """The ``split`` ("train" | "test") of your rows, from ``cfg.train_path`` / ``cfg.test_path``;
    scored by ``"math"`` unless ``reward.fn`` says otherwise.

    Raises:
        ValueError: unknown split, a malformed row (file, line or row, field), an empty file.
        FileNotFoundError: the file is missing.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split '{split}' is not 'train' or 'test'")
    key = f"data.{split}_path"
    path = resolve_data_path(getattr(cfg, f"{split}_path"))

    def parse(row: dict, source: str) -> TaskItem:
        turns, answer = parse_row(row, cfg)
        return TaskItem(prompt=turns, answer=answer, row=row, source=source)

    items = read_items(path, parse, what=f"row ({key})")
    if not items:
        what = "blank lines only" if path.stat().st_size else "the file is empty"
        raise ValueError(f"{key}={path} holds no rows ({what}); give a JSONL file with "
                         f"one JSON object per line, or a Parquet file")
    return ChatTask("file", items, system=cfg.system_prompt or None)
