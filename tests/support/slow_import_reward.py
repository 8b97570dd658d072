"""A reward function whose module takes 2 s to import, as a verifier that loads a large library
does: a pool's process imports it before its first call, so that call's timeout does not count it."""

import time

time.sleep(2.0)


def full_credit(response: str, gold: str) -> float:
    return 1.0
