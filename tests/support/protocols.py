"""Checking a class against a seam's ``typing.Protocol`` call for call, beyond what ``isinstance``
of a ``runtime_checkable`` Protocol sees (only that the names exist): each method ``async`` on
both sides or on neither, the same parameters in the same order, extra ones only with defaults,
and the Protocol's defaults kept.
"""

from __future__ import annotations

import inspect


def check_calls(proto: type, cls: type) -> None:
    """Assert that ``cls`` has each method of ``proto`` with the same sync/async shape and
    parameters (names and order; extra trailing ones with defaults; the Protocol's defaults)."""
    methods = {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert methods, f"{proto.__name__} declares no methods"
    for name, want in methods.items():
        have = inspect.getattr_static(cls, name, None)
        where = f"{cls.__name__}.{name} (for {proto.__name__})"
        assert inspect.isfunction(have), f"{where} is missing or not a method"
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), \
            f"{where} is {'async' if inspect.iscoroutinefunction(have) else 'sync'}; the Protocol's is not"
        want_p = list(inspect.signature(want).parameters.values())
        have_p = list(inspect.signature(have).parameters.values())
        assert [p.name for p in have_p[:len(want_p)]] == [p.name for p in want_p], \
            f"{where} takes {[p.name for p in have_p]}, the Protocol {[p.name for p in want_p]}"
        assert all(p.default is not p.empty for p in have_p[len(want_p):]), \
            f"{where}: an extra parameter without default"
        for w, h in zip(want_p, have_p):
            if w.default is not w.empty:
                assert h.default == w.default, f"{where}: {h.name} defaults to {h.default!r}, not {w.default!r}"
