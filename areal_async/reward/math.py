"""Verifiable math reward: the last ``\\boxed{...}`` answer, checked for equivalence with math-verify.

``math_reward`` is 1.0 when equivalent to the gold answer, else 0.0 (no box, empty, unparsable);
both sides first go through ``normalize_answer``. math-verify's timeouts work only in a main thread,
so the caller bounds the time (the reward pool kills a stuck process).
"""

from __future__ import annotations

import re
import threading

_BOX_OPENERS = ("\\boxed", "\\fbox")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_NUMBER_THEN_WORDS = re.compile(r"^\s*(-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?)\s*[A-Za-z][A-Za-z .]*$")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance.

    Escaped braces ``\\{`` ``\\}`` inside do not count. The brace-less form ``\\boxed 5`` gives
    the token after the space. A final box cut off before its closing brace (a truncated
    response) is skipped in favour of an earlier complete one.

    Args:
        text: a model response.

    Returns:
        The stripped content (may be ``""`` for ``\\boxed{}``), or ``None`` when there is no
        complete box.
    """
    starts = sorted(
        (m.start() for opener in _BOX_OPENERS for m in re.finditer(re.escape(opener), text)),
        reverse=True,
    )
    for start in starts:
        opener = next(o for o in _BOX_OPENERS if text.startswith(o, start))
        content = _box_content(text, start + len(opener))
        if content is not None:
            return content.strip()
    return None


def _box_content(text: str, i: int) -> str | None:
    """Content after an opener ending at ``text[i]``: a balanced ``{...}`` or ``' token'``."""
    start = i
    while i < len(text) and text[i] in " \t\n":
        i += 1
    if i >= len(text) or text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:]) if i > start else None
        return token.group(0) if token else None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
            j += 2  # an escaped brace is a literal character, not grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def normalize_answer(answer: str) -> str:
    """Light normalisation applied to both sides before math-verify: ``\\text{..}`` unwrapped, thin
    spaces and ``{,}`` dropped inside numbers, a number followed only by words ("18 dollars")
    reduced to the number."""
    s = _TEXT_WRAP.sub(r"\1", answer)
    s = re.sub(r"(?<=\d)(?:\\,|\\!|\{,\}|\\ )(?=\d)", "", s)
    m = _NUMBER_THEN_WORDS.match(s)
    if m:
        s = m.group(1)
    return s.strip()


def math_reward(response: str, gold: str) -> float:
    """1.0 if the last boxed answer of ``response`` is equivalent to ``gold``, else 0.0.

    math-verify handles ``\\$``, ``%``, thousands commas, ``72.0`` vs ``72`` and ``\\frac{1}{2}`` vs
    ``0.5``; ``normalize_answer`` does what GSM8K answers need beyond that.

    Args:
        response: decoded model output (any text; the answer must be in ``\\boxed{}``).
        gold: reference answer, plain (``"72"``) or LaTeX (``"\\frac{1}{2}"``).

    Returns:
        ``1.0`` or ``0.0``. Never raises for unparsable input (math-verify returns no match);
        errors of math-verify itself propagate to the caller (the pool counts them).
    """
    from math_verify import parse, verify

    answer = extract_boxed(response)
    if not answer:
        return 0.0
    limit_s = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"\\boxed{{{normalize_answer(gold)}}}", parsing_timeout=limit_s)
    pred_parsed = parse(f"\\boxed{{{normalize_answer(answer)}}}", parsing_timeout=limit_s)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=limit_s) else 0.0
