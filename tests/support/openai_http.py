"""Talking to the embedded server's ``/generate`` and ``/v1`` endpoints over HTTP in tests: a JSON
``post``, the ``events`` of a streamed answer, and a chat prompt's ids (``chat_ids``, ``PROMPT``)."""

from __future__ import annotations

import json

from transformers import AutoTokenizer


async def post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def events(http, url: str, body: dict) -> list:
    """The server-sent events of a streamed answer: each ``data:`` payload, JSON-decoded except
    the last, which must be ``[DONE]``."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream", await resp.text()
        raw = (await resp.read()).decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), raw[:500]
    payloads = [b[len("data: "):] for b in blocks[:-1]]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def chat_ids(model_dir, messages: list[dict]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


PROMPT = [{"role": "user", "content": "How many apples are left?"}]
