"""The scripts of ``tools/`` as modules, for the tests of what they compute."""

from __future__ import annotations

import importlib.util
import sys

from tests.support import REPO


def load_tool(name: str):
    """``tools/<name>.py`` imported as module ``name`` (once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
