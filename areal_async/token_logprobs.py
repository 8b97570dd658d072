"""Per-token log-probs in OpenAI's shapes, from a tokenizer's ids and the engine's numbers.

A token's text is its id decoded alone, special tokens kept (SGLang's ``return_text_in_logprobs``).
Completions: ``{text_offset, token_logprobs, tokens, top_logprobs}`` (``text_offset`` -1 and
``top_logprobs`` ``[]`` as SGLang's; a token that is a fragment of a UTF-8 character is written one
character per raw byte, latin-1). Chat: ``{content: [{token, bytes, logprob, top_logprobs: []}]}``,
``bytes`` the token's raw bytes in a byte-level BPE vocabulary (a character split over tokens is
their concatenation), else its text's UTF-8. Used by the embedded server's ``/v1`` answers and by
an episode's recording endpoint (``rollout/openai_endpoint.py``).
"""

from __future__ import annotations


def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` table inverted: the printable character a byte-level BPE
    vocabulary stores for each byte → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for c, b in zip(chars, printable)}


BYTE_DECODER = _byte_decoder()


class LogprobRenderer:
    """OpenAI-shaped log-probs of one tokenizer's tokens (the module docstring says how)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_level: bool | None = None

    @property
    def byte_level(self) -> bool:
        """Whether the vocabulary stores tokens as GPT-2 byte characters (SGLang's
        ``_is_byte_level_tokenizer``: the tokenizer's ``is_byte_level`` if it has one, else every
        character of six sampled tokens is in the byte table)."""
        if self._byte_level is None:
            flag = getattr(self.tokenizer, "is_byte_level", None)
            if isinstance(flag, bool):
                self._byte_level = flag
            else:
                vocab = len(self.tokenizer.get_vocab())
                pieces = [self.tokenizer.convert_ids_to_tokens(i) for i in (0, 1, 2, 3, vocab // 2, vocab - 2)
                          if 0 <= i < vocab]
                self._byte_level = all(ch in BYTE_DECODER for piece in pieces if piece for ch in piece)
        return self._byte_level

    def texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone (special tokens kept), as SGLang's ``detokenize_logprob_tokens``."""
        return self.tokenizer.batch_decode([[t] for t in ids]) if ids else []

    def raw_bytes(self, token_id: int) -> list[int] | None:
        """The token's own bytes in a byte-level vocabulary; ``None`` where the tokenizer is not
        byte-level or the token has a character outside the byte table (SGLang's ``token_id_to_bytes``)."""
        if not self.byte_level:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not piece or any(ch not in BYTE_DECODER for ch in piece):
            return None
        return [BYTE_DECODER[ch] for ch in piece]

    def _lossless(self, token_id: int, text: str) -> str:
        """``text``, or for a fragment of a UTF-8 character (its raw bytes are not valid UTF-8) those
        bytes as latin-1, one character each (SGLang's ``_lossless_token_text``)."""
        if "\ufffd" not in text:
            return text
        raw = self.raw_bytes(token_id)
        if raw is None:
            return text
        try:
            bytes(raw).decode("utf-8")
            return text  # a whole character (e.g. U+FFFD itself): keep its text
        except UnicodeDecodeError:
            return bytes(raw).decode("latin-1")

    def completion(self, ids: list[int], logprobs: list[float]) -> dict:
        """``/v1/completions``' ``logprobs`` of tokens ``ids`` (one log-prob each)."""
        assert len(ids) == len(logprobs), f"{len(ids)} tokens with {len(logprobs)} log-probs"
        tokens = [self._lossless(t, s) for t, s in zip(ids, self.texts(ids))]
        return {"text_offset": [-1] * len(ids), "token_logprobs": list(logprobs), "tokens": tokens,
                "top_logprobs": []}

    def chat(self, ids: list[int], logprobs: list[float]) -> dict:
        """``/v1/chat/completions``' ``logprobs`` of tokens ``ids`` (one log-prob each)."""
        assert len(ids) == len(logprobs), f"{len(ids)} tokens with {len(logprobs)} log-probs"
        content = []
        for t, text, lp in zip(ids, self.texts(ids), logprobs):
            raw = self.raw_bytes(t)
            content.append({"token": text, "bytes": list(text.encode("utf-8")) if raw is None else raw,
                            "logprob": lp, "top_logprobs": []})
        return {"content": content}
