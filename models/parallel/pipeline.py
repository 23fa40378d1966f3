"""Pipeline parallelism: the decoder layers split into consecutive stages, one per rank.

Rank 0 runs the first layers (and holds the media towers), the last rank the last ones; each
stage receives the hidden states from the rank before it (``recv``) and sends its own on
(``send``), and the last stage's output reaches every rank (``all_gather``), where the final norm
and the head make the logits, so every rank samples the same token from the same numbers. The
embedding table is split by vocabulary rows as in tensor parallelism (``modules.vocabulary_rows``:
every rank looks up the ids it holds, one ``all_sum``; the tied head gathers every rank's rows of
the logits), so no rank holds the whole table; of Gemma 4's per-layer inputs each rank holds the
table columns and projection rows of its own layers.

The plan (``stage_bounds``) splits the layers evenly, except that a KV-shared layer stays on the
rank of the layer whose keys and values it reads: the layers from the first donor on form one
stage (E2B's 35 layers, the last 20 KV-shared, in the default pattern: layers 11-34). Sending a donor's keys and values to another rank would mean a
second copy of its cache there, written in step with it; this plan sends hidden states only.

Prefill chunks (``window`` reads of plain text) are cut into micro-batches that go through the
stages one after the other: while stage 1 runs micro-batch 1, stage 0 runs micro-batch 2. Each
micro-batch is one more ``window`` read on every layer's cache, the same as a smaller prefill
chunk. A decode step is one position: the stages take turns.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn

from cache import Read
from graphs.layers import CheckedCaches
from weights.shards import SKIP, Decision, Part

from models.parallel.modules import layer_columns, vocabulary_rows
from models.parallel.sharding import LAYER_KEY, Sharding, decoder_of
from models.registry import DecoderShape

# Prefill micro-batches: at most this many per chunk and ranks, and none shorter than MIN_MICRO_BATCH positions.
MICRO_BATCHES_PER_RANK = 2
MIN_MICRO_BATCH = 32


def stage_bounds(dims: DecoderShape, size: int) -> list[int]:
    """``[0, b1, ..., L]``: rank r runs layers ``[b_r, b_{r+1})``. An even split, unless its last
    boundary falls after the first KV donor: then the layers from that donor on are the last stage
    (every KV-shared layer on its donor's rank) and the others share the layers before it evenly.
    Raises ``ValueError`` (the reason) when ``size`` stages do not fit."""
    L = dims.num_hidden_layers
    limit = L - 1 if dims.first_kv_donor is None else dims.first_kv_donor
    if size - 1 > limit:
        shared = "" if dims.first_kv_donor is None else f" (layers {limit}-{L - 1} share keys and values, so they form one stage)"
        raise ValueError(f"{L} layers give at most {limit + 1} stages{shared}")
    if round((size - 1) * L / size) <= limit:
        return [round(k * L / size) for k in range(size + 1)]
    # The shared tail [limit, L) is the last stage; the others split the layers before it evenly.
    return [round(k * limit / (size - 1)) for k in range(size)] + [L]


class Elsewhere(nn.Module):
    """A decoder layer another rank runs: no weights here, never called."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("pipeline: this layer runs on another rank")


class PipelineParallel(Sharding):
    mode = "pipeline"

    def configure(self, dims: DecoderShape, raw: Mapping[str, Any]) -> None:
        self.dims = dims
        try:
            self.bounds = stage_bounds(dims, self.size)
        except ValueError as err:
            raise self.refuse(str(err)) from None
        self.start, self.end = self.bounds[self.rank], self.bounds[self.rank + 1]
        if dims.vocab_size % self.size:
            raise self.refuse(f"vocab_size {dims.vocab_size} is not a multiple of {self.size}")

    def details(self) -> dict[str, Any]:
        return {"stages": self.bounds}

    def part_of(self, key: str, shape: tuple[int, ...]) -> Decision:
        layer = LAYER_KEY.search(key)
        if layer is not None:
            return None if self.start <= int(layer.group(1)) < self.end else SKIP
        module = key.split(".")[-2] if "." in key else ""
        L = self.dims.num_hidden_layers
        mine = ((Fraction(self.start, L), Fraction(self.end, L)),)
        if module == "embed_tokens_per_layer":
            return Part(-1, mine)
        if module == "per_layer_model_projection":
            return Part(0, mine)
        if module in ("embed_tokens", "lm_head"):
            share = ((Fraction(self.rank, self.size), Fraction(self.rank + 1, self.size)),)
            return Part(0, share, transposed=True)  # the output head's CPU layout
        return None

    def shape(self, graph: nn.Module) -> None:
        decoder = decoder_of(graph)
        for i in range(len(decoder.layers)):
            if not self.start <= i < self.end:
                decoder.layers[i] = Elsewhere()
        H, rows = self.dims.hidden_size, self.dims.vocab_size // self.size
        decoder.embed_tokens = nn.Embedding(rows, H)
        if "lm_head" in decoder:
            decoder.lm_head = nn.Linear(H, rows, bias="bias" in decoder.lm_head)
        P = self.dims.per_layer_input
        if P:
            width = (self.end - self.start) * P
            decoder.embed_tokens_per_layer = nn.Embedding(self.dims.vocab_size_per_layer_input, width)
            decoder.per_layer_model_projection = nn.Linear(H, width, bias=False)

    def join(self, graph: nn.Module) -> nn.Module:
        decoder = decoder_of(graph)
        decoder.embed_tokens = vocabulary_rows(decoder.embed_tokens, self.rank * self.dims.vocab_size // self.size, self.group)
        if "lm_head" in decoder:
            decoder.lm_head = vocabulary_rows(decoder.lm_head, 0, self.group)
        decoder.head_blocks = None  # row blocks of the split head would skip the gather (graphs.speedups)
        P, L = self.dims.per_layer_input, self.dims.num_hidden_layers
        if P:
            before, after = self.start * P, (L - self.end) * P
            decoder.embed_tokens_per_layer = layer_columns(decoder.embed_tokens_per_layer, before, after)
            decoder.per_layer_model_projection = layer_columns(decoder.per_layer_model_projection, before, after)
        stage = PipelineStage(decoder, self.bounds, self.group)
        if "language_model" in graph:
            graph.language_model = stage
            return graph
        return stage


class PipelineStage(CheckedCaches, nn.Module):
    """One rank's stage of a text decoder (Gemma 4's or Gemma 3's): called as the decoder is
    (``__call__``, ``forward``, ``make_cache``), its caches are those of its own layers, which it
    runs through the decoder's own layer loop (``run_layers``)."""

    # It evaluates inside its forward (collectives in a fixed order), which no compiled step can
    # trace: one-position forwards stay plain (graphs.decode_step).
    traceable = False

    def __init__(self, decoder: nn.Module, bounds: list[int], group: mx.distributed.Group):
        super().__init__()
        self.decoder = decoder
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.start, self.end = bounds[self.rank], bounds[self.rank + 1]
        self.micro_batches = MICRO_BATCHES_PER_RANK * self.size

    @property
    def config(self):
        return self.decoder.config

    def make_cache(self) -> list:
        """The caches of this stage's layers (KV-shared views of donors on this stage)."""
        return self.decoder.make_cache()[self.start : self.end]

    def __call__(self, input_ids: mx.array, cache: list | None = None, last_only: bool = False, with_hidden: bool = False):
        read = Read.decode() if cache is not None and input_ids.shape[1] == 1 else Read.window()
        return self.forward(input_ids, self.make_cache() if cache is None else cache, read, last_only, with_hidden)

    def forward(self, tokens, cache: list, read: Read, last_only: bool = False, with_hidden: bool = False):
        """As the decoder's ``forward``: the logits (and the final normed hidden states), on every rank."""
        self.check_cache(cache)
        decoder = self.decoder
        # Every rank embeds the whole chunk (the lookup is split over the ranks' vocabulary rows; the
        # per-layer inputs are each rank's own layers'), once, before the micro-batches.
        embedded = decoder.embed(tokens)
        per_layer = decoder.per_layer_inputs(tokens, embedded) if "embed_tokens_per_layer" in decoder else None
        # Collectives must meet in the same order on every rank, and the stages' graphs differ (only
        # rank 0 reads the embedding, only the others wait on a recv): so each one is evaluated in turn.
        mx.eval(embedded if per_layer is None else (embedded, per_layer))
        pieces = self._micro_batches(tokens, read, embedded.shape[1])
        finals = []
        for n, (a, b) in enumerate(pieces):
            final = n == len(pieces) - 1
            need = "all" if not last_only else ("last" if final else "none")
            if len(pieces) > 1:
                part = (embedded[:, a:b], None if per_layer is None else per_layer[:, a:b])
            else:
                part = (embedded, per_layer)
            h = self._stage(*part, cache, read, need)
            if h is not None:
                finals.append(h)
        h = decoder.norm(finals[0] if len(finals) == 1 else mx.concatenate(finals, axis=1))
        logits = decoder.logits(h)
        return (logits, h) if with_hidden else logits

    def _micro_batches(self, tokens, read: Read, length: int) -> list[tuple[int, int]]:
        """Position ranges of the micro-batches: only text prefill chunks (``window`` reads) are cut."""
        count = min(self.micro_batches, length // MIN_MICRO_BATCH)
        if self.size == 1 or read.name != "window" or not isinstance(tokens, mx.array) or count < 2:
            return [(0, length)]
        bounds = [round(k * length / count) for k in range(count + 1)]
        return list(zip(bounds, bounds[1:]))

    def _stage(self, embedded: mx.array, per_layer: mx.array | None, cache: list, read: Read, need: str) -> mx.array | None:
        """This rank's layers on one micro-batch; the last stage's output on every rank (``need``:
        every position, the last one, or none when only the caches are wanted)."""
        decoder, last = self.decoder, self.rank == self.size - 1
        B, L, H = embedded.shape
        offset = cache[0].offset  # the stage's first layer owns storage (KV-shared layers follow their donor)
        h = embedded if self.rank == 0 else mx.distributed.recv((B, L, H), embedded.dtype, self.rank - 1, group=self.group)
        h = decoder.run_layers(h, per_layer, cache, offset, read, range(self.start, self.end), need)
        if not last:
            h = mx.distributed.send(h, self.rank + 1, group=self.group)
        mx.eval(h)  # this micro-batch leaves now, while the next one is built
        if need == "none":
            return None
        if need == "last":
            h = h[:, -1:]
        if self.size == 1:
            return h
        # Every rank's last-stage output: the last rank's rows of the gather (the others' are placeholders).
        final = mx.distributed.all_gather(h, group=self.group)[(self.size - 1) * B :]
        mx.eval(final)
        return final
