"""A reward function whose module hangs when a reward process imports it (and only there: the
test that names it imports it too)."""

import multiprocessing
import time

if multiprocessing.current_process().name == "reward":
    time.sleep(600)


def full_credit(response: str, gold: str) -> float:
    return 1.0
