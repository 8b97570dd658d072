"""The embedded server's error answers: one body for all, SGLang's ``{"error": {"message": ...}}``.

HTTP 400 for bad input (the message names the field, the rule and the fix), 401 without the
token, 500 for a generation with non-finite log-probs or a dead engine, 503 for a full waiting
queue (with ``Retry-After``, ``admission.py``) or an unhealthy server. ``json_body`` reads a
request's JSON object or raises that 400. The ``/v1`` endpoints answer OpenAI's body instead
(``openai_api.py``), the weight endpoints SGLang's ``{"success": false, "message"}``
(``weight_api.py``).
"""

from __future__ import annotations

import json

from aiohttp import web

from . import fields
from .engine.admission import QueueFull, retry_after_headers


def error_json(message: str) -> str:
    """The body of every error answer, SGLang's ``{"error": {"message": ...}}``, as JSON text."""
    return json.dumps({"error": {"message": message}})


def error(message: str, status: int = 400) -> web.Response:
    """An error answer for a handler to return: HTTP ``status`` with the ``error_json`` body."""
    return web.Response(text=error_json(message), status=status, content_type="application/json")


def bad_request(message: str) -> web.HTTPBadRequest:
    """HTTP 400 with the ``error_json`` body, for code that raises rather than returns (``json_body``)."""
    return web.HTTPBadRequest(text=error_json(message), content_type="application/json")


def overloaded(exc: QueueFull) -> web.Response:
    """HTTP 503 with ``Retry-After`` for a call the waiting queue has no room for (``admission.py``)."""
    return web.Response(text=error_json(str(exc)), status=503, content_type="application/json",
                        headers=retry_after_headers())


async def json_body(request: web.Request) -> dict:
    """The request's JSON object (an empty body: ``{}``); raises HTTP 400 naming what is wrong."""
    try:
        return await fields.json_object(request, allow_empty=True)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
