"""Reward functions of each form for the tests, importable by the reward pool's processes.

``record`` and ``record_some`` append the arguments they were called with, as one JSON line, to
the file named by the item's ``record_to`` field, so a test sees exactly what crossed to the
process; they score 1.0 when the item's ``target`` is in the response.
"""

from __future__ import annotations

import json


def _record(item: dict, got: dict) -> float:
    with open(item["record_to"], "a") as f:
        f.write(json.dumps(got, sort_keys=True) + "\n")
    return float(item["target"] in got.get("response", item["target"]))


def record(response, answer, messages, item) -> float:
    return _record(item, {"response": response, "answer": answer, "messages": messages, "item": item})


def record_some(item, *, response) -> float:
    return _record(item, {"response": response, "item": item})


def record_all(**kwargs) -> float:
    return _record(kwargs["item"], kwargs)


def prompts_completions(prompts, completions, **kwargs) -> float:
    """TRL's shape: fits neither form."""
    return 0.0
