"""Prompts with images: placeholder expansion, the image spans, and prefill chunks that keep images whole.

A Gemma 4 prompt carries one placeholder token per image (``<|image|>``, which the chat template
writes). Before the model sees it, each placeholder becomes ``boi`` + n image tokens + ``eoi``,
where n is that image's soft-token count, exactly as transformers' ``Gemma4Processor`` expands it.
The n positions are the image's *span*; the model overwrites their embeddings with the image's
features (in sequence order).

On sliding layers the tokens of one image attend to each other in both directions, so an image's
keys depend on the whole image: a prefill read must never stop inside one (the cache refuses a
split it can see, and this module never produces one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from graphs.gemma4_multimodal_config import ImageTokenIds


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its soft tokens occupy positions ``[start, end)``; ``features`` is
    ``[end - start, text hidden]``, the rows that replace those positions' embeddings."""

    start: int
    end: int
    features: mx.array

    def __post_init__(self) -> None:
        rows = int(self.features.shape[0])
        if self.end - self.start != rows:
            raise ValueError(
                f"image span [{self.start}, {self.end}) holds {self.end - self.start} image tokens, "
                f"but its features give {rows} soft tokens"
            )

    def shifted(self, offset: int) -> "ImageSpan":
        return ImageSpan(self.start + offset, self.end + offset, self.features)


@dataclass(frozen=True)
class Prompt:
    """Token ids ready for the model (placeholders already expanded) and the images inside them."""

    ids: list[int]
    images: tuple[ImageSpan, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.ids)

    def suffix(self, start: int) -> "Prompt":
        """The prompt from position ``start`` on; ``start`` must not fall inside an image."""
        for span in self.images:
            if span.start < start < span.end:
                raise ValueError(f"cannot cut the prompt at {start}: it falls inside the image at [{span.start}, {span.end})")
        return Prompt(self.ids[start:], tuple(s.shifted(-start) for s in self.images if s.start >= start))


def expand_image_placeholders(ids: Sequence[int], features: Sequence[mx.array], tokens: ImageTokenIds) -> Prompt:
    """Replace the i-th image placeholder with ``boi`` + ``features[i].shape[0]`` image tokens + ``eoi``.

    Every occurrence of ``tokens.image`` in ``ids`` is a placeholder (as in transformers'
    processor), so ``ids`` must not be expanded already.
    """
    placeholders = sum(1 for t in ids if t == tokens.image)
    if placeholders != len(features):
        raise ValueError(
            f"the prompt has {placeholders} image placeholder{'s' * (placeholders != 1)} (token {tokens.image}) "
            f"but {len(features)} image{'s' * (len(features) != 1)} {'were' if len(features) != 1 else 'was'} given"
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    remaining = iter(features)
    for token in ids:
        if token != tokens.image:
            out.append(int(token))
            continue
        image = next(remaining)
        out.append(tokens.boi)
        start = len(out)
        out.extend([tokens.image] * int(image.shape[0]))
        spans.append(ImageSpan(start, len(out), image))
        out.append(tokens.eoi)
    return Prompt(out, tuple(spans))


class Span(NamedTuple):
    """Positions ``[start, end)`` that one read must take whole (an image's soft tokens)."""

    start: int
    end: int


def token_runs(ids: np.ndarray, token: int) -> list[Span]:
    """The maximal runs of positions where any row of ``ids [B, L]`` holds ``token`` (batched images)."""
    hit = np.concatenate([[False], (np.asarray(ids) == token).any(axis=0), [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [Span(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def prefill_chunks(length: int, images: Sequence[ImageSpan | Span], step: int) -> list[tuple[int, int]]:
    """``[start, end)`` reads of at most ``step`` positions covering ``[0, length)``, none inside an image.

    Both generation loops (autoregressive and block diffusion) chunk their prompts with it.

    A boundary that would land inside an image moves back to the image's start; when the image
    starts the chunk (it is longer than what is left of the step), the chunk runs to the image's
    end instead, so an image longer than ``step`` goes whole in one read.
    """
    if step < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {step}")
    _check_spans(length, images)
    bounds = []
    start = 0
    while start < length:
        end = min(start + step, length)
        for span in images:
            if span.start < end < span.end:
                end = span.start if span.start > start else span.end
                break
        bounds.append((start, end))
        start = end
    return bounds


def _check_spans(length: int, images: Sequence[ImageSpan | Span]) -> None:
    # Adjacent spans would read as one image (the reference's blocks are runs of image tokens).
    previous_end = -1
    for span in images:
        if not previous_end < span.start < span.end <= length:
            raise ValueError(
                f"image spans must be ordered, separated and inside the prompt of {length} positions; "
                f"got [{span.start}, {span.end}) after a span ending at {previous_end}"
            )
        previous_end = span.end
