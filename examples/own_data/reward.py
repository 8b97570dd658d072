"""A keyword-form reward function for examples/own_data (docs/configuration.md#your-own-data).

Named in the config as ``reward.fn: examples.own_data.reward:within_tolerance``; it takes the
response, the row's answer and the row itself (``item``), whose ``tolerance`` field is the
allowed absolute error.
"""

from __future__ import annotations

from areal_async.reward.math import extract_boxed


def within_tolerance(response: str, answer: str, item: dict) -> float:
    """1.0 when the last ``\\boxed{}`` number is within ``item["tolerance"]`` of ``answer``."""
    boxed = extract_boxed(response)
    try:
        value = float((boxed or "").replace(",", ""))
    except ValueError:
        return 0.0
    return float(abs(value - float(answer)) <= item.get("tolerance", 0))
