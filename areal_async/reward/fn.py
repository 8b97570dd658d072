"""Reward functions: the registry (``REWARD_FNS``), resolving ``reward.fn``, and the two forms.

A reward function is a top-level function (so that the pool's processes import it by reference)
returning a number, 1.0 correct or 0.0 wrong (> 0.5 counts as correct); under ``reward.graded``
a value in [0, 1], scaled linearly between ``wrong`` and ``correct`` (1.0 counts as correct). Its form is read from its
signature once, at resolution:

- **answer form** ``fn(response, gold)``: two positional parameters (any names but the keyword
  form's), called positionally. The built-in ``math`` is one.
- **keyword form**: every required parameter is one of ``KEYWORDS``, passed by keyword, only those
  it names (``**kwargs``: all four). ``response``: the decoded response; ``answer``: the item's
  answer (the gold); ``messages``: the prompt's chat turns, then ``{"role": "assistant",
  "content": response}``; ``item``: the item's row as read (every field; ``{}`` for a task with no
  rows). ``fn(response, answer)`` is both forms, with one meaning.

A signature that fits neither is a ``ValueError`` at resolution, before any process starts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from areal_async.reward.math import math_reward
from areal_async.reward.running_sum import longchain_steps

RewardFn = Callable[..., float]

REWARD_FNS: dict[str, RewardFn] = {"math": math_reward, "longchain_steps": longchain_steps}

KEYWORDS = ("response", "answer", "messages", "item")


def fn_name(fn: RewardFn) -> str:
    """``module:qualname`` of a reward function (its import path), for messages."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def resolve_reward_fn(fn: str | RewardFn) -> RewardFn:
    """A reward function from a ``REWARD_FNS`` name, a ``module:function`` path, or itself, its
    form checked (``keywords``).

    Raises:
        ValueError: unknown name, an import path that does not import, or a signature of neither
            form (each names the fix).
    """
    if callable(fn):
        resolved = fn
    elif fn in REWARD_FNS:
        resolved = REWARD_FNS[fn]
    else:
        module, sep, attr = fn.partition(":")
        if not sep:
            raise ValueError(f"unknown reward function '{fn}'; registered: {sorted(REWARD_FNS)}, "
                             f"or give an import path 'package.module:function'")
        try:
            resolved = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"reward function '{fn}' does not import ({exc}); the module must be "
                             f"importable from the working directory or PYTHONPATH") from None
    keywords(resolved)
    return resolved


def keywords(fn: RewardFn) -> tuple[str, ...] | None:
    """The ``KEYWORDS`` that ``fn`` takes (keyword form, in ``KEYWORDS`` order), or ``None`` for
    the answer form ``fn(response, gold)``.

    Raises:
        ValueError: ``fn`` has a signature of neither form; names its parameters and both forms.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"reward function {fn_name(fn)} has no signature Python can read; wrap it "
                         f"in a def of one of the two forms") from None
    P = inspect.Parameter
    params = list(sig.parameters.values())
    var_positional = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind == P.VAR_KEYWORD for p in params)
    required = [p for p in params if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if not var_positional and all(p.name in KEYWORDS and p.kind != P.POSITIONAL_ONLY for p in required):
        if var_keyword:
            return KEYWORDS
        named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        if named & set(KEYWORDS):
            return tuple(k for k in KEYWORDS if k in named)
    if not var_keyword:  # TRL's (prompts, completions, **kwargs) must not pass as (response, gold)
        try:
            sig.bind("response", "gold")
            return None
        except TypeError:
            pass
    plain = sig.replace(parameters=[p.replace(annotation=P.empty) for p in params],
                        return_annotation=P.empty)
    raise ValueError(
        f"reward function {fn_name(fn)}{plain} fits neither form: fn(response, gold) with two "
        f"positional parameters, or parameters named from {', '.join(KEYWORDS)} (or **kwargs), "
        f"passed by keyword; e.g. def reward(response, answer, item) -> float")
