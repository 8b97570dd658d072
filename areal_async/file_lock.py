"""Lock files removed when released: the launcher's run lock and the model cache's lock.

``file_lock(path)`` holds an exclusive ``flock`` while its block runs and removes the file before
letting go; a waiter that then finds ``path`` names another file (or none) opens it again, so two
holders never lock different files. A SIGKILLed holder leaves its file unlocked for the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: str | pathlib.Path, wait: bool = True) -> Iterator[None]:
    """Hold ``path`` locked while the block runs, then remove it.

    Args:
        path: the lock file, created if absent (its directory must exist).
        wait: block while another process holds it; ``False``: raise instead.

    Raises:
        BlockingIOError: ``wait`` is ``False`` and another process holds the lock.
    """
    path = pathlib.Path(path)
    while True:
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BaseException:
            lock.close()
            raise
        if _names(path, lock):
            break
        lock.close()
    try:
        yield
    finally:
        if _names(path, lock):
            path.unlink()
        lock.close()


def _names(path: pathlib.Path, file) -> bool:
    """Whether ``path`` is the open ``file`` (not removed, nor replaced by another file)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(file.fileno()))
    except FileNotFoundError:
        return False
