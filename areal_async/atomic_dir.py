"""Directories written atomically: a reader sees the previous directory or the new one, never a mix.

``D`` is written into ``D.partial``; ``publish`` renames ``D`` to ``D.old`` and ``D.partial`` to ``D``,
then removes ``D.old`` (one left between the renames is put back by a caller that can tell it is
whole, ``trainer.resume.recover_checkpoint``); ``remove_atomically`` renames ``D`` away first.
Published files get the user's usual mode (``0o666 & ~umask``, not safetensors' ``0600``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
from typing import Iterator


def staging_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
    """``out_dir.partial``: where ``out_dir`` is written before ``publish`` puts it in place."""
    out_dir = pathlib.Path(out_dir)
    return out_dir.with_name(out_dir.name + ".partial")


def old_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
    """``out_dir.old``: the previous ``out_dir`` while ``publish`` swaps the new one in."""
    out_dir = pathlib.Path(out_dir)
    return out_dir.with_name(out_dir.name + ".old")


def new_staging_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
    """An empty ``staging_dir(out_dir)``; what an earlier, unpublished write left there is removed."""
    staging = staging_dir(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def user_file_mode() -> int:
    """``0o666 & ~umask``: the mode of a file this process creates with ``open``. The umask is read
    from ``/proc/self/status`` where there is one (setting it to read it back would also apply to
    files other threads create meanwhile)."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)$", pathlib.Path("/proc/self/status").read_text(), re.M)
    except OSError:
        found = None
    if found:
        umask = int(found[1], 8)
    else:  # not Linux, or a kernel before 4.7 (no Umask line)
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_user_file_mode(directory: str | pathlib.Path) -> None:
    """Give every file under ``directory`` ``user_file_mode()``."""
    mode = user_file_mode()
    for path in pathlib.Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def publish(out_dir: str | pathlib.Path) -> None:
    """Swap ``staging_dir(out_dir)`` in as ``out_dir`` (two renames, see the module docstring), its
    files given ``user_file_mode()`` first."""
    out_dir = pathlib.Path(out_dir)
    give_user_file_mode(staging_dir(out_dir))
    old = old_dir(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    staging_dir(out_dir).rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def write_atomically(out_dir: str | pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield an empty staging directory for ``out_dir``; when the block ends, ``publish`` it, or
    remove it if the block raised."""
    staging = new_staging_dir(out_dir)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(out_dir)


def remove_atomically(out_dir: str | pathlib.Path) -> None:
    """Remove ``out_dir``: rename it to ``out_dir.removed`` (one step: ``out_dir`` is whole or
    absent), then delete that. Nothing happens when it does not exist."""
    out_dir = pathlib.Path(out_dir)
    gone = out_dir.with_name(out_dir.name + ".removed")
    shutil.rmtree(gone, ignore_errors=True)
    try:
        out_dir.rename(gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)
