"""Log-probabilities in the API's two shapes: chat's ``{"content": [...]}`` and completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

A token's text is its own bytes (a byte-fallback piece ``<0xE2>`` is that byte; ``▁`` is a space),
decoded with replacement characters where the token holds part of a character; ``bytes`` gives the
exact bytes, as the API does. One entry per generated token, reasoning and markers included, as
vLLM reports them.
"""

from __future__ import annotations

import re

from models.generation.processors import TokenLogprob

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each token's bytes and text, looked up once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        raw = self._bytes.get(token)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            byte = BYTE_PIECE.fullmatch(piece)
            raw = bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
            self._bytes[token] = raw
        return raw

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")

    def chat_entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}

    def chat(self, items: list[TokenLogprob]) -> dict:
        """Chat's ``logprobs`` object for ``items``."""
        return {"content": [
            {**self.chat_entry(i.token, i.logprob), "top_logprobs": [self.chat_entry(t, v) for t, v in i.top]} for i in items
        ], "refusal": None}  # fmt: skip

    def completion(self, items: list[TokenLogprob], offset: int = 0) -> dict:
        """Completions' ``logprobs`` object for ``items``, text offsets counted from ``offset``."""
        tokens = [self.text(i.token) for i in items]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens, "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{self.text(t): v for t, v in i.top} for i in items], "text_offset": offsets,
        }  # fmt: skip
