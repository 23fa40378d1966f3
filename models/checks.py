"""What the user-facing calls check before ids reach the graph, and the errors they raise.

An id outside ``[0, vocab_size)`` is not caught by MLX: the embedding gather reads outside its
table (garbage text for 999999 or -5, a segfault for 2**30). So every call that takes ids
(``Model.logits/forward/prompt/stream/generate``, ``DiffusionModel.prompt/stream``) checks them
here, and ``models.load`` refuses a tokenizer whose ids run past the model's vocabulary. A model
loaded without a tokenizer still computes logits and generates ids; what needs text says which
files it looked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

# Special files (FIFOs, devices, folders) refused by name wherever a path is read; the examples
# take it from here (they import models, not weights).
from weights.resolve import NotAFileError, regular_file  # noqa: F401

# The files that make a folder's tokenizer; without one of them no tokenizer is loaded.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary (or not an integer)."""


class NoTokenizerError(ValueError):
    """Text was given (or asked for) but the model was loaded without a tokenizer."""


class TokenizerLoadError(ValueError):
    """The folder's tokenizer files could not be loaded (damaged, or they need code from the folder)."""


class VocabularyMismatchError(ValueError):
    """The tokenizer has more ids than the model's embedding table has rows."""


def check_token_ids(ids: mx.array | Sequence, vocab_size: int, where: str) -> None:
    """Raise ``TokenIdError`` naming the first id outside ``[0, vocab_size)``, its position and the
    vocabulary size. ``ids``: an ``mx.array`` (any shape, integer dtype) or a list of ints."""
    if isinstance(ids, mx.array):
        if not mx.issubdtype(ids.dtype, mx.integer):
            raise TokenIdError(f"{where}: token ids must be integers, got an array of {ids.dtype}")
        if ids.size == 0 or (mx.min(ids).item() >= 0 and mx.max(ids).item() < vocab_size):
            return
        values = np.array(ids)
        bad = np.argwhere((values < 0) | (values >= vocab_size))[0]
        token, position = int(values[tuple(bad)]), tuple(int(i) for i in bad)
        if values.ndim == 2 and values.shape[0] == 1:
            position = position[1:]  # one row: its position is the whole story
    else:
        for index, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise TokenIdError(f"{where}: token ids must be ints, got {token!r} at position {index}")
            if not 0 <= token < vocab_size:
                break
        else:
            return
        token, position = int(token), (index,)
    at = f"position {position[-1]}" + (f" of row {position[0]}" if len(position) == 2 else "")
    raise TokenIdError(f"{where}: token id {token} at {at} is outside the vocabulary of {vocab_size} ids [0, {vocab_size})")


def id_array(ids: mx.array | Sequence, vocab_size: int, where: str) -> mx.array:
    """``ids`` (an array, a list of ids or a list of rows) as a checked ``mx.array``."""
    if not isinstance(ids, mx.array):
        try:
            ids = mx.array(ids)
        except (RuntimeError, ValueError, TypeError, OverflowError):
            rows = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
            for row in rows:  # names the id that does not convert (past 64 bits, not a number)
                check_token_ids(row, vocab_size, where)
            raise TokenIdError(f"{where}: token ids must be a list of ints or of equally long rows of ints") from None
    check_token_ids(ids, vocab_size, where)
    return ids


def id_list(ids: Sequence | mx.array | np.ndarray, vocab_size: int, where: str) -> list[int]:
    """A prompt's ids (a list, or a 1-D ``mx.array`` / numpy array) as a checked list of ints."""
    if isinstance(ids, (mx.array, np.ndarray)):
        ids = ids.tolist()
    ids = list(ids)
    check_token_ids(ids, vocab_size, where)
    return [int(t) for t in ids]


def no_tokenizer_error(folder: Path, what: str, remedy: str = "pass token ids instead, or add the tokenizer files") -> NoTokenizerError:
    """The error for ``what`` (encoding text, rendering a chat...) on a model without a tokenizer."""
    folder = Path(folder)
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    why = (
        f"it was loaded with tokenizer=False ({folder} has {', '.join(present)})"
        if present
        else f"{folder} has none of {', '.join(TOKENIZER_FILES)}"
    )
    return NoTokenizerError(f"{what} needs a tokenizer, and this model has no tokenizer: {why}; {remedy}")


def tokenizer_vocabulary_size(tokenizer) -> int:
    """How many ids ``tokenizer`` can produce: ``len(tokenizer)``, or one past its largest added id if higher."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return max(len(tokenizer), max(added, default=-1) + 1)
