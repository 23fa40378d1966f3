"""A Gemma tokenizer rebuilt from a GGUF's own vocabulary, for both tokenizer models llama.cpp writes.

``tokenizer.ggml.model`` says where the merges come from:

* ``"llama"`` (Gemma 3): a SentencePiece vocabulary without merges. llama.cpp changes two things on
  the way: runs of spaces are spelled with real spaces instead of ``▁``, and every control and
  user-defined piece gets the score -1000 where SentencePiece had 0. transformers' GGUF converter
  (``integrations/gguf/gguf_tokenizer_mapping.gemma_tokenizer``) undoes the first and sorts the
  rebuilt merges by token position; on Gemma 3 that puts the whitespace-run merges in a different
  order than the released tokenizer, and a run of 32+ spaces then splits differently. Undoing the
  second as well (score 0 again for every non-normal piece) and sorting by score, as transformers'
  SentencePiece converter does for ``tokenizer.model``, gives exactly the released merge list.
* ``"gemma4"``: the same kind of vocabulary with its BPE merges stored in ``tokenizer.ggml.merges``,
  used as they are. No ``<bos>`` is added automatically even though the file sets
  ``add_bos_token``: the Gemma 4 chat template writes it, as in transformers' own GGUF import.

Both go through transformers' ``GemmaTokenizer``, which builds Gemma's whole pipeline around the
vocabulary and merges it is given (BPE with byte fallback on text whose spaces become ``▁``, the
matching decoder, the BOS post-processor). The added tokens follow one rule, as in transformers'
converter: control pieces are special; user-defined pieces (space and newline runs, HTML tags,
Gemma 4's ``<|channel>`` ...) and ``<unusedN>`` pieces the file marks normal (Gemma 4 does; Gemma 3
marks them control) are plain added tokens. Either way text containing them is never cut into pieces.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from tokenizers import AddedToken
from transformers import GemmaTokenizer
from transformers.tokenization_utils_base import generate_merges

# llama.cpp's token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
SPIECE_SPACE = "\u2581"
MODELS = ("llama", "gemma4")

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}
_UNUSED = re.compile(r"<unused\d+>")


def gemma_tokenizer_from_gguf(
    metadata: Mapping[str, Any],
    chat_template: str | None = None,
    *,
    extra_special_tokens: Mapping[str, str] | None = None,
) -> GemmaTokenizer:
    """The tokenizer a Gemma GGUF describes, with ``chat_template`` when the file carries none.

    ``metadata`` maps GGUF keys to values (arrays as lists). ``extra_special_tokens`` names pieces of
    the vocabulary (``{"image_token": "<|image|>"}``) for ``tokenizer.image_token`` and friends.
    Raises ``ValueError`` naming the key when the tokenizer model is neither ``llama`` nor
    ``gemma4``, or a field is missing or inconsistent.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise ValueError(
            f"GGUF tokenizer: tokenizer.ggml.model is {model!r}; only {' and '.join(map(repr, MODELS))} are supported"
        )
    tokens = [_respell(t) for t in _required(metadata, "tokenizer.ggml.tokens")]
    types = [int(t) for t in _required(metadata, "tokenizer.ggml.token_type")]
    if len(tokens) != len(types):
        raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens and {len(types)} token types must be equally many")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer: tokenizer.ggml.tokens holds duplicate tokens")
    if model == "llama":
        merges = _merges_from_scores(vocab, types, _required(metadata, "tokenizer.ggml.scores"))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    else:
        merges = _stored_merges(_required(metadata, "tokenizer.ggml.merges"))
        add_bos = False

    specials = {
        name: tokens[_token_id(metadata, key, len(tokens))] for name, key in _SPECIAL_IDS.items() if key in metadata
    }
    missing = sorted(set((extra_special_tokens or {}).values()) - set(vocab))
    if missing:
        raise ValueError(f"GGUF tokenizer: the vocabulary lacks the named tokens {missing}")
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        add_bos_token=add_bos,
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template", chat_template),
        clean_up_tokenization_spaces=False,
        **({"extra_special_tokens": dict(extra_special_tokens)} if extra_special_tokens else {}),
        **specials,
    )
    # Special in the backend (skipped by decode(skip_special_tokens=True)) without listing thousands
    # of <unusedN> pieces among the named special tokens.
    tokenizer.add_tokens(_added(tokens, types, special=True), special_tokens=True)
    tokenizer.add_tokens(_added(tokens, types, special=False))
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context:
        tokenizer.model_max_length = int(context)
    if len(tokenizer) != len(tokens):
        raise ValueError(
            f"GGUF tokenizer: the rebuilt tokenizer has {len(tokenizer)} ids, the file lists {len(tokens)} tokens"
        )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], types: list[int], scores) -> list[tuple[str, str]]:
    """SentencePiece's merges, best first, from the scores (0 again for every non-normal piece)."""
    if len(scores) != len(vocab):
        raise ValueError(
            f"GGUF tokenizer: {len(vocab)} tokens and {len(scores)} scores (tokenizer.ggml.scores) must be equally many"
        )
    spm_scores = {token: (float(score) if kind == NORMAL else 0.0) for token, score, kind in zip(vocab, scores, types)}
    return generate_merges(vocab, spm_scores)


def _stored_merges(merges) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` ("left right", best first) as pairs."""
    pairs = [tuple(merge.split(" ")) for merge in merges]
    bad = next((merge for merge, pair in zip(merges, pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"GGUF tokenizer: tokenizer.ggml.merges holds {bad!r}, not two pieces separated by one space")
    return pairs


def _added(tokens: list[str], types: list[int], special: bool) -> list[AddedToken]:
    """The special (control) or the plain added pieces, matched whole in the raw text."""

    def chosen(token: str, kind: int) -> bool:
        if special:
            return kind == CONTROL
        return kind == USER_DEFINED or (kind == NORMAL and _UNUSED.fullmatch(token) is not None)

    return [AddedToken(t, normalized=False, special=special) for t, k in zip(tokens, types) if chosen(t, k)]


def _respell(token: str) -> str:
    """A run of real spaces back to SentencePiece's ``▁`` spelling."""
    return SPIECE_SPACE * len(token) if token and set(token) == {" "} else token


def _required(metadata: Mapping[str, Any], key: str):
    if key not in metadata:
        raise ValueError(f"GGUF tokenizer: the file has no {key}")
    return metadata[key]


def _token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int:
    value = int(metadata[key])
    if not 0 <= value < vocab_size:
        raise ValueError(f"GGUF tokenizer: {key} = {value} is outside the vocabulary of {vocab_size} tokens")
    return value
