"""Which weights an inference server the launcher restarts starts from (``trainer.weight_sync=disk``).

``pin`` finds the newest whole ``v{N}/`` of a directory the disk sync writes (``RUN_DIR/weights``:
full weights; ``RUN_DIR/adapters``: a LoRA job's adapters; ``complete_versions``) and links its
files into ``RUN_DIR/restart_weights/server{i}/v{N}/``, which only the launcher removes, so the
trainer cannot remove them while the server loads them; none: the original command line
(docs/faults.md#an-inference-server-dies-or-hangs).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

_VERSION_DIR = re.compile(r"v(\d+)")


def complete_versions(versions_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """``(N, versions_dir/v{N})`` of every complete version directory, newest first (only the
    exact name ``v{N}`` counts: ``.partial`` and removed ones do not, ``areal_async/atomic_dir.py``)."""
    try:
        entries = list(pathlib.Path(versions_dir).iterdir())
    except FileNotFoundError:
        return []
    found = [(int(m[1]), p) for p in entries if (m := _VERSION_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _link_tree(src: pathlib.Path, dst: pathlib.Path) -> None:
    """``dst``, a new directory holding ``src``'s files as hard links (copies where linking is
    refused, e.g. across file systems). Raises ``FileNotFoundError`` if ``src`` or one of its files
    disappears meanwhile."""
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        target = dst / path.name
        if path.is_dir():
            _link_tree(path, target)
            continue
        try:
            os.link(path, target)
        except FileNotFoundError:
            raise
        except OSError:  # no hard links here (EXDEV, EPERM): a copy
            shutil.copy2(path, target)


def pin(versions_dir: pathlib.Path, pin_dir: pathlib.Path, attempts: int = 3) -> tuple[int, pathlib.Path] | None:
    """The newest complete version in ``versions_dir`` (full weights or an adapter) as
    ``(N, pin_dir/v{N})``, its files linked there (hard links); what ``pin_dir`` held before is
    removed first. A version removed while it was being linked is given up for the newest one then,
    ``attempts`` times at most; ``None``: no complete version (the server starts as it first did)."""
    pin_dir = pathlib.Path(pin_dir)
    shutil.rmtree(pin_dir, ignore_errors=True)
    for _ in range(attempts):
        versions = complete_versions(versions_dir)
        if not versions:
            return None
        version, src = versions[0]
        dst = pin_dir / src.name
        try:
            _link_tree(src, dst)
        except FileNotFoundError:  # the trainer removed it: a newer version is complete by now
            shutil.rmtree(dst, ignore_errors=True)
            continue
        return version, dst
    return None
