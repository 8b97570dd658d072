"""A reward that a random tiny model earns about half the time, for end-to-end tests.

Scores 1.0 when the decoded response has an even number of characters: mixed rewards within a
group, hence non-zero GRPO advantages and real gradients, without a model that can do maths.
"""


def even_length(response: str, gold: str) -> float:
    return float(len(response) % 2 == 0)
