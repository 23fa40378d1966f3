"""A loaded model: its graph, config, tokenizer and generation defaults, with the user-facing calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx

from cache import SharedView

from .generate import DEFAULT_PREFILL_STEP, GenerationStats, SamplingOptions, generate_tokens


@dataclass
class Chunk:
    """One step of a stream: the new text (possibly empty while a character is incomplete) and its token."""

    text: str
    token: int | None
    stats: GenerationStats


class Model:
    """What ``models.load`` returns; the examples use exactly these calls."""

    def __init__(self, graph, config, tokenizer, generation_config: dict, path: Path, model_type: str):
        self.graph = graph
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.path = Path(path)
        self.model_type = model_type

    # ------------------------------------------------------------------------------ forward
    def make_cache(self) -> list:
        """One cache per layer (views for KV-shared layers), empty."""
        return self.graph.make_cache()

    def forward(self, input_ids: mx.array, cache, last_only: bool = False) -> mx.array:
        self._check_context(cache, input_ids.shape[-1])
        return self.graph(input_ids, cache=cache, last_only=last_only)

    def logits(self, input_ids, cache=None) -> mx.array:
        """Logits ``[B, L, V]`` of ``input_ids``.

        Without a cache: a full forward over the ids. With a cache from ``make_cache()``: the ids are
        appended (a ``window`` read for several positions, ``decode`` for one) and the logits of
        those positions are returned.
        """
        ids = input_ids if isinstance(input_ids, mx.array) else mx.array(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        return self.forward(ids, cache)

    @property
    def max_context(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def _check_context(self, cache, new: int) -> None:
        limit = self.max_context
        offset = cache_offset(cache)
        if limit is not None and offset + new > limit:
            raise ValueError(
                f"the prompt does not fit the context: {offset} cached + {new} new positions > "
                f"max_position_embeddings {limit}"
            )

    # ---------------------------------------------------------------------------- generation
    @property
    def stop_ids(self) -> set[int]:
        """End-of-turn and EOS ids: ``generation_config.json`` first, then the tokenizer's."""
        ids = self.generation_config.get("eos_token_id", [])
        ids = {ids} if isinstance(ids, int) else set(ids or [])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(eos)
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        cache=None,
        max_tokens: int = 256,
        sampling: SamplingOptions | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        should_stop=lambda: False,
    ) -> Iterator[Chunk]:
        """Stream text as it is generated; no chunk ever splits a multi-byte character."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        cache = self.make_cache() if cache is None else cache
        stats = GenerationStats()
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for token in generate_tokens(
            self.forward,
            ids,
            cache,
            sampling=sampling,
            max_tokens=max_tokens,
            stop_ids=self.stop_ids,
            prefill_step_size=prefill_step_size,
            should_stop=should_stop,
            stats=stats,
        ):
            detokenizer.add_token(token)
            yield Chunk(detokenizer.last_segment, token, stats)
        detokenizer.finalize()
        yield Chunk(detokenizer.last_segment, None, stats)

    def generate(self, prompt: str | Sequence[int], **options) -> str:
        return "".join(chunk.text for chunk in self.stream(prompt, **options))


def owning_caches(cache: list) -> list:
    """The caches that own storage (KV-shared views are skipped: they follow their donors)."""
    return [c for c in cache if not isinstance(c, SharedView)]


def cache_offset(cache) -> int:
    if not cache:
        return 0
    return owning_caches(cache)[0].offset


def trim_cache(cache: list, n: int) -> bool:
    """Drop the newest ``n`` positions from every layer, all or none; False if any layer cannot."""
    layers = owning_caches(cache)
    if not all(c.can_trim(n) for c in layers):
        return False
    for c in layers:
        c.trim(n)
    return True
