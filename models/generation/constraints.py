"""Constrained decoding: a grammar as a mask on each step's logits, with llguidance.

A ``Grammar`` names what an answer must match: a JSON schema (``json_schema``; ``json_object`` is
any object), a regular expression (``regex``) or a context-free grammar (``lark``, in llguidance's
Lark dialect, or GBNF as llama.cpp and vLLM write it, converted by llguidance). ``Grammar.compile``
checks it against a tokenizer and gives a ``Constraint``: one answer's parser state, which masks the
logits of each step to the tokens the grammar allows next (the stop ids only once the grammar is
complete) and advances by the token drawn. ``TokenSampler`` applies it after the request's logits
processors, so the generate loop, the batch generator (one state per row) and the server share it.

Why llguidance (``benchmarks/grammar_masks.py``, ``docs/server.md``): on the 262,144-token Gemma
vocabulary its mask costs tens of microseconds per token and a schema compiles in about a
millisecond (xgrammar: ~0.1-0.25 s per schema; outlines-core: seconds), it reads JSON schema,
regexes, Lark and GBNF, and it refuses a schema keyword it does not implement by name rather than
ignoring it. JSON is compact (no whitespace between tokens), so a small model cannot wander into
endless whitespace.

The mask is computed on the host while the step's forward runs (the logits are queued with
``mx.async_eval`` first).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: item separator ",", key separator ":"


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message says what (a schema keyword, a regex fault)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as err:
        raise GrammarError("constrained decoding needs llguidance: pip install -e \".[server]\"") from err
    return llguidance


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer, vocab_size: int, eos: int):
    """llguidance's view of a Hugging Face tokenizer's Rust backend, or of that backend itself (what ``llguidance.hf`` does,
    without its check for the ``PreTrainedTokenizerFast`` class, which transformers 5's tokenizers
    are not); about 10 s for a 262k vocabulary, so built once per tokenizer."""
    backend = tokenizer if hasattr(tokenizer, "to_str") else getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(f"constrained decoding needs a tokenizer with a Rust (tokenizers) backend, not {type(tokenizer).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return _llguidance().LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


@dataclass(frozen=True)
class Grammar:
    """What an answer must match: ``kind`` (one of ``KINDS``) and its ``source`` (a schema as a dict
    or JSON text, a regex, a grammar's text; None for ``json_object``)."""

    kind: str
    source: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r}: must be one of {KINDS}")
        if self.kind != "json_object" and not isinstance(self.source, (str, dict)):
            raise GrammarError(f"a {self.kind} grammar needs its source as text{' or a dict' if self.kind == 'json_schema' else ''}, "
                               f"got {type(self.source).__name__}")  # fmt: skip

    def text(self) -> str:
        """The grammar in llguidance's serialized form."""
        ll = _llguidance().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.source
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as err:
                    raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return ll.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return ll.grammar_from_regex(self.source)
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return ll.grammar_from_lark(gbnf_to_lark(self.source))
            except Exception as err:  # the converter raises its own parse errors
                raise GrammarError(f"the GBNF grammar does not parse: {err}") from None
        return ll.grammar_from_lark(self.source)

    def check(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]) -> tuple:
        """``(llguidance tokenizer, grammar text, sorted stop ids)`` once the grammar compiles over
        ``tokenizer``'s ids below ``vocab_size``; ``GrammarError`` naming what llguidance cannot
        compile (an unimplemented schema keyword, a bad regex or rule). Touches no MLX state, so
        any thread may call it."""
        stops = sorted(stop_ids)
        if not stops:
            raise GrammarError("constrained decoding needs at least one stop id to end a complete answer")
        lltokenizer = _lltokenizer(getattr(tokenizer, "_tokenizer", tokenizer), vocab_size, stops[0])  # a wrapper's inner tokenizer
        text = self.text()
        failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, lltokenizer)
        if failed:
            raise GrammarError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {messages[0]}")
        return lltokenizer, text, stops

    def compile(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]) -> "Constraint":
        """A fresh ``Constraint`` (``check`` first)."""
        lltokenizer, text, stops = self.check(tokenizer, vocab_size, stop_ids)
        return Constraint(_llguidance().LLMatcher(lltokenizer, text), vocab_size, stops)


class Constraint:
    """One answer's grammar state (see the module docstring). ``mask(logits [1, V])`` keeps the
    allowed tokens; ``advance(token)`` moves past a drawn token (a stop id ends the answer)."""

    def __init__(self, matcher, vocab_size: int, stop_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.eos = stop_ids[0]  # llguidance's end-of-answer token: allowed once the grammar is complete
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The next token's mask as 32-bit words (bit ``i % 32`` of word ``i // 32``: id ``i``); the
        stop ids all stand for llguidance's end-of-answer token."""
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding: the grammar's state broke: {self.matcher.get_error()}")
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = words.view(np.uint32)
        can_stop = bool(bits[self.eos // 32] >> np.uint32(self.eos % 32) & 1)
        for stop in self.stop_ids:
            word, flag = stop // 32, np.uint32(1 << (stop % 32))
            bits[word] = bits[word] | flag if can_stop else bits[word] & ~flag
        return words

    def mask(self, logits: mx.array) -> mx.array:
        mx.async_eval(logits)  # the forward runs while the host computes the mask
        words = mx.array(self.allowed())
        bits = ((words[:, None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(-1)[: logits.shape[-1]]
        return mx.where(bits.astype(mx.bool_), logits, -float("inf"))

    def advance(self, token: int) -> None:
        if token in self.stop_ids:
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding: token {token} is not allowed here ({self.matcher.get_error()})")
