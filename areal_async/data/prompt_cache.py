"""On-disk cache of a task's tokenised prompts, so a process does not render and tokenise every
prompt again on each start (~2 CPU-s for GSM8K's training split).

An entry holds the token ids of every item (before the ``max_prompt_len`` filter, which
``PromptSet`` applies after reading) under the sha256 of all they depend on: every item's chat
turns (``task.messages``: the data, few-shot demonstrations, system turn, instruction), the
tokenizer as loaded (its class, serialised pipeline, chat template, special and added tokens and
loading arguments) and its directory's files (weights aside), the versions of transformers,
tokenizers and jinja2, and ``FORMAT`` (raise it when ``tokenize_all`` changes).
Entries are written whole (compressed, synced, then renamed into place) under a lock, so processes
that start together tokenise once; an entry that cannot be read is a miss. A read is checked: the
stored key, and three items (first, middle, last) tokenised again must equal what is stored; else
the entry is rebuilt (status ``stale``).
Not cached: a tokenizer not loaded from a local directory, or a template that reads the clock.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import pathlib

import msgspec
import numpy as np

from areal_async.file_lock import file_lock

FORMAT = 2
KEPT_ENTRIES = 64  # the most recently used entries kept; older ones are removed on a write
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
CLOCK_MARKERS = ("strftime", "now(")  # a template that renders today's date
LIBRARIES = ("transformers", "tokenizers", "jinja2")
WHERE_KWARGS = {"name_or_path", "vocab_file", "merges_file", "tokenizer_file", "is_local", "local_files_only"}


def cache_dir_of(cfg) -> pathlib.Path:
    """The prompt cache of a run's ``Config``: ``prompts/`` under ``model.cache_dir``."""
    return pathlib.Path(cfg.model.cache_dir).expanduser() / "prompts"


def tokenize_all(task, tokenizer, indices=None) -> list[list[int]]:
    """Token ids of items ``indices`` (default all) of ``task``: chat template applied with the
    generation prompt, no special tokens added."""
    indices = range(len(task)) if indices is None else indices
    texts = [tokenizer.apply_chat_template(task.messages(i), tokenize=False, add_generation_prompt=True)
             for i in indices]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def cache_key(task, tokenizer) -> str | None:
    """The hex sha256 naming ``task``'s entry for ``tokenizer``, or ``None`` if not cacheable."""
    template = getattr(tokenizer, "chat_template", None)
    directory = pathlib.Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not template or not directory.is_dir() or any(m in str(template) for m in CLOCK_MARKERS):
        return None
    h = hashlib.sha256()

    def part(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little") + data)

    part(f"format {FORMAT}; {type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    for lib in LIBRARIES:
        try:
            part(f"{lib} {importlib.metadata.version(lib)}".encode())
        except importlib.metadata.PackageNotFoundError:
            part(f"{lib} -".encode())
    part(msgspec.json.encode(template))
    try:  # the loaded tokenizer as it is (changed after loading too: its pipeline, special and added tokens)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        part(backend.to_str().encode() if backend is not None else b"-")
        kwargs = {k: v for k, v in getattr(tokenizer, "init_kwargs", {}).items() if k not in WHERE_KWARGS}
        part(msgspec.json.encode([getattr(tokenizer, "special_tokens_map", {}), tokenizer.get_added_vocab(),
                                  kwargs], enc_hook=repr))
    except (AttributeError, TypeError, msgspec.EncodeError):
        return None
    try:
        for path in sorted(directory.iterdir()):
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
                part(path.name.encode())
                part(hashlib.sha256(path.read_bytes()).digest())
    except OSError:  # a file that cannot be read (loading the tokenizer may not need it): not cached
        return None
    try:
        part(msgspec.json.encode([task.messages(i) for i in range(len(task))]))
    except (TypeError, msgspec.EncodeError):
        return None
    return h.hexdigest()


def cached_token_ids(task, tokenizer, cache_dir: str | pathlib.Path | None) -> tuple[list, str]:
    """Token ids of every item of ``task`` (as ``tokenize_all``) and how they were had: ``off``
    (no ``cache_dir``, or not cacheable), ``hit``, ``miss`` (tokenised and stored) or ``stale``
    (an entry under the same key failed its check; tokenised and stored again) or ``unwritable``
    (tokenised; the cache directory could not take the entry)."""
    key = cache_key(task, tokenizer) if cache_dir not in (None, "") else None
    if key is None:
        return tokenize_all(task, tokenizer), "off"
    directory = pathlib.Path(cache_dir).expanduser()
    path = directory / f"{key}.npz"
    ids, status = _read(path, key, task, tokenizer)
    if ids is not None:
        return ids, status
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with file_lock(directory / f"{key}.lock"):
            ids, status = _read(path, key, task, tokenizer)  # another process may have written it
            if ids is None:
                ids = tokenize_all(task, tokenizer)
                _write(path, key, ids)
    except OSError:
        ids = ids if ids is not None else tokenize_all(task, tokenizer)
        status = status if status == "hit" else "unwritable"
    return ids, status


def _read(path: pathlib.Path, key: str, task, tokenizer) -> tuple[list | None, str]:
    """``(ids, "hit")`` from a whole entry that passes its check; ``(None, "miss" | "stale")``."""
    try:
        with np.load(path, allow_pickle=False) as entry:
            stored_key, flat, offsets = bytes(entry["key"]).decode(), entry["ids"], entry["offsets"]
    except Exception:  # absent, truncated, corrupt (zipfile.BadZipFile, a bad CRC): tokenised anew
        return None, "miss"
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: kept by _prune (a read-only cache is still read)
    n = len(task)
    if (stored_key != key or len(offsets) != n + 1 or flat.dtype != np.int32 or offsets.dtype != np.int64
            or (n and (offsets[0] != 0 or offsets[-1] != len(flat) or np.any(np.diff(offsets) < 0)))):
        return None, "stale"
    ids = [flat[offsets[i]:offsets[i + 1]] for i in range(n)]
    probe = sorted({0, n // 2, n - 1}) if n else []
    if any(list(fresh) != ids[i].tolist() for i, fresh in zip(probe, tokenize_all(task, tokenizer, probe))):
        return None, "stale"
    return ids, "hit"


def _write(path: pathlib.Path, key: str, ids: list) -> None:
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and (flat.min() < 0 or flat.max() >= 2**31):
        return  # not int32 ids: PromptSet stores int32, so such a set is never cached
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, key=np.frombuffer(key.encode(), dtype=np.uint8), ids=flat.astype(np.int32),
                                offsets=offsets)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before it is named: a crash leaves no torn entry
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _prune(path.parent)


def _prune(directory: pathlib.Path) -> None:
    """Remove all but the ``KEPT_ENTRIES`` most recently used entries."""
    entries = []
    for p in directory.glob("*.npz"):
        try:
            entries.append((p.stat().st_mtime, p))
        except OSError:
            pass
    for _, p in sorted(entries, reverse=True)[KEPT_ENTRIES:]:
        p.unlink(missing_ok=True)
