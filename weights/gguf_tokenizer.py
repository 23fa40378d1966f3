"""A Gemma tokenizer rebuilt from a GGUF's own vocabulary (tokens, scores, token types).

llama.cpp stores a SentencePiece ("llama") vocabulary without merges, and it changes two things on
the way: runs of spaces are spelled with real spaces instead of ``▁``, and every control and
user-defined piece gets the score -1000 where SentencePiece had 0. transformers' GGUF converter
(``integrations/gguf/gguf_tokenizer_mapping.gemma_tokenizer``) undoes the first and sorts the rebuilt
merges by token position; on Gemma 3 that puts the whitespace-run merges in a different order than
the released tokenizer, and a run of 32+ spaces then splits differently. Undoing the second as well
(score 0 again for every non-normal piece) and sorting by score, as transformers' SentencePiece
converter does for ``tokenizer.model``, gives exactly the released merge list, so the ids match the
released Gemma 3 tokenizer.

The rest is transformers' own machinery: ``GemmaTokenizer`` supplies the normalizer, pre-tokenizer,
decoder and BOS post-processor, ``generate_merges`` the merges; control pieces become special added
tokens and user-defined pieces (newline and space runs, HTML tags) plain added tokens, as in
transformers' converter.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken
from transformers import GemmaTokenizer
from transformers.tokenization_utils_base import generate_merges

# llama.cpp's token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
SPIECE_SPACE = "\u2581"

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gemma_tokenizer_from_gguf(metadata: Mapping[str, Any], chat_template: str | None = None) -> GemmaTokenizer:
    """The tokenizer a Gemma GGUF describes, with ``chat_template`` when the file carries none.

    ``metadata`` maps GGUF keys to values (arrays as lists). Raises ``ValueError`` naming the key
    when the vocabulary is not a SentencePiece one or a field is missing or inconsistent.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(
            f"GGUF tokenizer: tokenizer.ggml.model is {model!r}; only 'llama' (SentencePiece) is supported"
        )
    tokens = [_respell(t) for t in _required(metadata, "tokenizer.ggml.tokens")]
    scores = _required(metadata, "tokenizer.ggml.scores")
    types = _required(metadata, "tokenizer.ggml.token_type")
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(
            f"GGUF tokenizer: {len(tokens)} tokens, {len(scores)} scores and {len(types)} token types must be equally many"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer: tokenizer.ggml.tokens holds duplicate tokens")
    spm_scores = {token: (float(score) if kind == NORMAL else 0.0) for token, score, kind in zip(tokens, scores, types)}

    specials = {
        name: tokens[_token_id(metadata, key, len(tokens))] for name, key in _SPECIAL_IDS.items() if key in metadata
    }
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=generate_merges(vocab, spm_scores),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template", chat_template),
        clean_up_tokenization_spaces=False,
        **specials,
    )
    # Special in the backend (skipped by decode(skip_special_tokens=True)) without listing thousands
    # of <unusedN> pieces among the named special tokens.
    tokenizer.add_tokens(_added(tokens, types, CONTROL, special=True), special_tokens=True)
    tokenizer.add_tokens(_added(tokens, types, USER_DEFINED, special=False))
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context:
        tokenizer.model_max_length = int(context)
    if len(tokenizer) != len(tokens):
        raise ValueError(
            f"GGUF tokenizer: the rebuilt tokenizer has {len(tokenizer)} ids, the file lists {len(tokens)} tokens"
        )
    return tokenizer


def _added(tokens: list[str], types: list[int], kind: int, special: bool) -> list[AddedToken]:
    """The pieces of one token type as added tokens, matched whole in the raw text."""
    return [AddedToken(t, normalized=False, special=special) for t, k in zip(tokens, types) if k == kind]


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
