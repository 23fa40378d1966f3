"""A loaded text-embedding model (EmbeddingGemma): ``embed(texts, prompt_name=..., dimensions=...)``.

The encoder (``graphs.gemma3_text.Gemma3TextModel.encode``) runs texts packed end to end, without
padding (``cache.PackedCache``), in batches of similar length; the sentence-transformers head of the
checkpoint folder (``models.sentence_modules``) pools, projects and normalizes. Matryoshka sizes
keep the first ``dimensions`` values and renormalize, as sentence-transformers' ``truncate_dim``
followed by normalization does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from graphs.layers import float_dtype

from models.sentence_modules import SentenceSettings, sentence_head, sentence_settings

# The sizes EmbeddingGemma was trained to be cut to (Matryoshka representation learning; the
# google/embeddinggemma-300m model card): a model's own size and those of these below it are offered.
MATRYOSHKA_DIMENSIONS = (768, 512, 256, 128)
DEFAULT_BATCH_SIZE = 32
# Tokens per forward at most (a longer text runs alone): bounds the activations a batch holds
# (about 70 MB at 1,024 tokens for EmbeddingGemma 300M in float32) whatever batch_size is; docs/embedding.md.
MAX_BATCH_TOKENS = 1024


class EmbeddingModel:
    """What ``models.load`` returns for an encoder checkpoint with a sentence-transformers head."""

    def __init__(self, graph, config, tokenizer, path: Path, model_type: str):
        if tokenizer is None:
            raise ValueError(f"{path}: an embedding model needs its tokenizer files (tokenizer.json or tokenizer.model)")
        self.graph = graph
        self.config = config
        self.tokenizer = tokenizer
        self.path = Path(path)
        self.model_type = model_type
        self.settings: SentenceSettings = sentence_settings(self.path)
        self.head = sentence_head(self.path, config.hidden_size, float_dtype(graph.embed_tokens))
        self.dimension = self.head.config.dimension or config.hidden_size
        # The token limit: the smallest of the positions the encoder has, sentence_bert_config.json's
        # max_seq_length and the tokenizer's model_max_length (where sentence-transformers 6 keeps it).
        tokenizer_limit = getattr(tokenizer._tokenizer, "model_max_length", None)
        limits = [config.max_position_embeddings, self.settings.max_seq_length, tokenizer_limit]
        self.max_tokens = min(n for n in limits if isinstance(n, int) and 0 < n < 1 << 30)

    @property
    def prompts(self) -> dict[str, str]:
        """The checkpoint's task prompts (``config_sentence_transformers.json``), by name."""
        return dict(self.settings.prompts)

    @property
    def dimensions(self) -> tuple[int, ...]:
        """The embedding sizes ``embed`` offers: the full size and the Matryoshka sizes below it."""
        return (self.dimension,) + tuple(d for d in MATRYOSHKA_DIMENSIONS if d < self.dimension)

    def embed(
        self,
        texts: str | Sequence[str],
        prompt_name: str | None = None,
        dimensions: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        truncate: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Embeddings of ``texts`` as float32 ``[len(texts), dimensions]`` (``[dimensions]`` for one string).

        ``prompt_name`` picks a task prompt (default: the checkpoint's ``default_prompt_name``, often
        none); ``dimensions`` a Matryoshka size (``self.dimensions``). A text longer than
        ``max_tokens`` (prompt and special tokens included) is refused unless ``truncate``, which
        cuts it as sentence-transformers does. ``progress(n)`` is called as each batch of n texts is done.
        """
        ids = self.tokenize(texts, prompt_name, truncate)
        out = self.embed_tokens(ids, dimensions, batch_size, progress)
        return out[0] if isinstance(texts, str) else out

    def tokenize(self, texts: str | Sequence[str], prompt_name: str | None = None, truncate: bool = False) -> list[list[int]]:
        """The token ids ``embed`` runs for each text (prompt prepended, special tokens added)."""
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, Sequence) or not texts:
            raise ValueError(f"embed: texts must be a string or a non-empty list of strings, got {texts!r}")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"embed: texts[{i}] is a {type(text).__name__}, not a string")
        ids = self._ids(texts, prompt_name, truncate)
        for i, row in enumerate(ids):
            if len(row) > self.max_tokens:
                raise ValueError(
                    f"embed: texts[{i}] is {len(row)} tokens with its prompt, over the model's limit of {self.max_tokens}; "
                    "pass truncate=True to cut it"
                )
        return [list(row) for row in ids]

    def count_tokens(self, texts: Sequence[str], prompt_name: str | None = None) -> list[int]:
        """Each text's length in tokens with its prompt and special tokens, before any cut."""
        return [len(row) for row in self._ids(texts, prompt_name, False)]

    def _ids(self, texts: Sequence[str], prompt_name: str | None, truncate: bool) -> list[list[int]]:
        prompt = self._prompt(prompt_name)
        hf = self.tokenizer._tokenizer
        limit = self.max_tokens if truncate else None
        return hf([prompt + t for t in texts], add_special_tokens=True, truncation=truncate, max_length=limit)["input_ids"]

    def embed_tokens(
        self, ids: Sequence[Sequence[int]], dimensions: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
        progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Embeddings of texts given as token ids (``tokenize``), in batches of at most ``batch_size``
        texts of similar length and ``MAX_BATCH_TOKENS`` tokens (a longer text alone)."""
        dimensions = self.dimension if dimensions is None else dimensions
        if isinstance(dimensions, bool) or dimensions not in self.dimensions:
            raise ValueError(f"embed: dimensions {dimensions!r} is not supported; this model gives {self.dimensions}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"embed: batch_size must be a positive int, got {batch_size!r}")
        vocab = self.config.vocab_size
        for i, row in enumerate(ids):
            outside = [t for t in row if not 0 <= t < vocab]
            if not row or outside:
                shown = self.tokenizer._tokenizer.convert_ids_to_tokens(outside[:3]) if outside else "no tokens"
                raise ValueError(f"embed: text {i} has ids outside the model's table [0, {vocab}): {outside[:3]} {shown}")
        out = np.empty((len(ids), dimensions), dtype=np.float32)

        def finish(chosen: list[int], vectors: mx.array) -> None:
            out[chosen] = matryoshka(np.array(vectors.astype(mx.float32)), dimensions)
            if progress is not None:
                progress(len(chosen))

        # Each batch's graph is built and started while the one before it still computes.
        running = None
        for chosen in batches([len(row) for row in ids], batch_size, MAX_BATCH_TOKENS):
            lengths = [len(ids[i]) for i in chosen]
            packed = mx.array([t for i in chosen for t in ids[i]], dtype=mx.int32)[None]
            vectors = self.head(self.graph.encode(packed, lengths), lengths)
            mx.async_eval(vectors)
            if running is not None:
                finish(*running)
            running = (chosen, vectors)
        finish(*running)
        return out

    def _prompt(self, prompt_name: str | None) -> str:
        name = self.settings.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return ""
        if name not in self.settings.prompts:
            known = ", ".join(sorted(self.settings.prompts)) or "none"
            raise ValueError(f"embed: unknown prompt_name {name!r}; this model's prompts are: {known}")
        return self.settings.prompts[name]


def batches(lengths: Sequence[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Indices of texts of ``lengths``, longest first (similar lengths share a batch), cut into
    batches of at most ``batch_size`` texts and ``max_tokens`` tokens (a text over it alone)."""
    out: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if not out or len(out[-1]) == batch_size or tokens + lengths[i] > max_tokens:
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += lengths[i]
    return out


def matryoshka(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` values of each row, renormalized to unit length (unchanged at full size)."""
    if dimensions >= vectors.shape[-1]:
        return vectors
    cut = vectors[..., :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12)
