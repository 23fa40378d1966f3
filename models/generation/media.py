"""Prompts with audio clips and videos beside images: one placeholder expansion for every Gemma 4 modality.

The chat template writes one placeholder token per item: ``<|image|>``, ``<|audio|>``, ``<|video|>``.
Each becomes what transformers' ``Gemma4Processor`` writes in its place:

* image: ``boi`` + n image tokens + ``eoi`` (``replace_image_token``);
* audio: ``boa`` + n audio tokens + ``eoa`` (``replace_audio_token``: n from the clip's mel frames);
* video: for each sampled frame its ``mm:ss`` timestamp, a space, ``boi`` + n video tokens + ``eoi``,
  frames joined by a space (``replace_video_token``; n per frame from the video budget).

The processor substitutes text and tokenizes the result; we substitute ids and tokenize only the
timestamp text (``" 00:02 "``). The Gemma 4 tokenizer splits every digit and the colon, and special
tokens always cut the text, so the two agree token for token (checked on the real tokenizer in
``tests/test_gemma4_video_processor.py``).

Every soft-token run becomes an ``ImageSpan`` (the name predates audio): one per image, per audio
clip and per video frame, in sequence order, so the generation loops and the cache's
never-split-a-span rule need nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from graphs.gemma4_audio_config import MediaTokenIds
from graphs.gemma4_multimodal_config import ImageTokenIds

from models.generation.prompts import ImageSpan, Prompt


@dataclass(frozen=True)
class VideoFeatures:
    """One video's frames as the prompt places them: features per frame ``[n, hidden]`` and their times."""

    frames: tuple[mx.array, ...]
    timestamps: tuple[float, ...]  # seconds, one per frame
    source: str = "<video>"

    def __post_init__(self) -> None:
        if len(self.frames) != len(self.timestamps) or not self.frames:
            raise ValueError(f"video {self.source}: {len(self.frames)} frames but {len(self.timestamps)} timestamps")


def timestamp_text(seconds: float) -> str:
    """``mm:ss`` as ``Gemma4Processor.replace_video_token`` writes it (minutes past 99 keep growing)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def count_placeholders(ids: Sequence[int], token: int) -> int:
    return sum(1 for t in ids if t == token)


def expand_media_placeholders(
    ids: Sequence[int],
    image_tokens: ImageTokenIds,
    media_tokens: MediaTokenIds,
    *,
    images: Sequence[mx.array] = (),
    audio: Sequence[mx.array] = (),
    videos: Sequence[VideoFeatures] = (),
    encode_text: Callable[[str], list[int]] | None = None,
) -> Prompt:
    """Replace the i-th placeholder of each modality with its item's tokens (module docstring).

    ``encode_text`` tokenizes the timestamp text of video frames (without BOS); it is needed only
    when ``videos`` are given. A placeholder count that differs from the items of its modality
    raises ``ValueError`` with both numbers.
    """
    kinds = (
        ("image", image_tokens.image, images),
        ("audio clip", media_tokens.audio, audio),
        ("video", media_tokens.video, videos),
    )
    for name, token, items in kinds:
        found = count_placeholders(ids, token)
        if found != len(items):
            raise ValueError(
                f"the prompt has {found} {name} placeholder{'s' * (found != 1)} (token {token}) "
                f"but {len(items)} {name}{'s' * (len(items) != 1)} {'were' if len(items) != 1 else 'was'} given"
            )
    if videos and encode_text is None:
        raise ValueError("expand_media_placeholders: videos need encode_text for their timestamps")
    pending = {image_tokens.image: iter(images), media_tokens.audio: iter(audio), media_tokens.video: iter(videos)}
    out: list[int] = []
    spans: list[ImageSpan] = []

    def soft_run(open_id: int, token: int, features: mx.array, close_id: int) -> None:
        out.append(open_id)
        start = len(out)
        out.extend([token] * int(features.shape[0]))
        spans.append(ImageSpan(start, len(out), features))
        out.append(close_id)

    for token in ids:
        token = int(token)
        if token == image_tokens.image:
            soft_run(image_tokens.boi, image_tokens.image, next(pending[token]), image_tokens.eoi)
        elif token == media_tokens.audio:
            soft_run(media_tokens.boa, media_tokens.audio, next(pending[token]), media_tokens.eoa)
        elif token == media_tokens.video:
            video = next(pending[token])
            for index, (frame, seconds) in enumerate(zip(video.frames, video.timestamps)):
                out.extend(encode_text((" " if index else "") + timestamp_text(seconds) + " "))
                soft_run(image_tokens.boi, media_tokens.video, frame, image_tokens.eoi)
        else:
            out.append(token)
    return Prompt(out, tuple(spans))
