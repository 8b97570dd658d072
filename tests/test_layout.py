"""The package's layout rules, read from the source's import statements (no module is imported).

- The RL side reaches the embedded inference server only over HTTP: no product module outside
  ``areal_async/embedded/`` imports it (the launcher starts it with ``python -m``).
- The embedded engine (``embedded/engine/``) does not import the server around it.
- No import circle among product modules; no product file over 600 lines.
- No test module imports another test module (shared helpers live in ``tests/support/``).
- A process's start imports no module only some of its paths use (``LAZY``: checkpoints, reports,
  Ray, wandb, ...): no module its entry point imports at top level, transitively, imports one there.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("areal_async", "launcher")
MAX_LINES = 600
ENTRY_POINTS = ("areal_async.embedded.server", "areal_async.trainer.main", "areal_async.rollout.worker",
                "areal_async.queue.server", "launcher.local", "launcher.torchrun")
LAZY = ("torch.distributed.checkpoint", "matplotlib", "jinja2", "pyarrow", "datasets", "pandas", "ray", "wandb")


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(tree: ast.AST):
    """The nodes run when the module is imported: not in a function, nor under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_top_level(child)])
            continue
        yield node
        yield from _top_level(node)


def _imports(path: pathlib.Path, top_level: bool = False) -> set[str]:
    """Every module ``path`` imports, absolute, wherever the statement is (top level or in a
    function); ``top_level``: only the statements run when it is imported."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (_top_level(tree) if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _product_files() -> list[pathlib.Path]:
    return sorted(p for root in PRODUCT for p in (REPO / root).rglob("*.py"))


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in _product_files()}
    return {name: {m for m in _imports(p) if m in files and m != name} for name, p in files.items()}


def test_the_rl_side_never_imports_the_embedded_server():
    offenders = [f"{name} imports {m}" for name, deps in _graph().items()
                 if not name.startswith("areal_async.embedded") for m in deps
                 if m.startswith("areal_async.embedded")]
    assert not offenders, offenders


def test_the_embedded_engine_does_not_import_the_server_around_it():
    offenders = [f"{name} imports {m}" for name, deps in _graph().items()
                 if name.startswith("areal_async.embedded.engine") for m in deps
                 if m.startswith("areal_async.embedded") and not m.startswith("areal_async.embedded.engine")]
    assert not offenders, offenders


def test_the_product_has_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                walk(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    # a package's __init__ importing its own modules is no circle: drop edges from a package to its children
    circles = [c for c in circles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not circles, circles


def test_no_product_file_is_over_600_lines():
    long = {str(p.relative_to(REPO)): n for p in _product_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_test_module_imports_another():
    tests = {_module(p) for p in (REPO / "tests").glob("test_*.py")}
    offenders = [f"{_module(p)} imports {m}" for p in sorted((REPO / "tests").glob("*.py"))
                 for m in _imports(p) if m in tests and m != _module(p)]
    assert not offenders, offenders


def test_a_process_start_imports_no_module_only_some_paths_use():
    files = {_module(p): p for p in _product_files()}
    offenders, seen, todo = [], set(), list(ENTRY_POINTS)
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        for m in _imports(files[name], top_level=True):
            if any(m == lazy or m.startswith(lazy + ".") for lazy in LAZY):
                offenders.append(f"{name} imports {m}")
            parts = m.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # a package's __init__ runs too
    assert len(seen) > 60 and not offenders, offenders
