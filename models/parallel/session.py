"""A chat on rank 0 that the other ranks follow, turn by turn, in lockstep.

Every rank holds a ``ChatSession`` over its part of the model. Rank 0's session is wrapped in a
``LeadSession``: before each turn it shares the turn (the text and the processed images, whose
files only rank 0 can read) and every other rank, waiting in ``follow``, runs the very same
``ChatSession.send``. The ranks then make the same calls in the same order: the prompt checks, the
cache reuse, every prefill chunk and every token. They sample the same tokens because they sample
from the same logits (the split graphs give every rank the same numbers) with the same seed
(``shared_seed``), and at the end of each turn they compare what they generated: a difference is a
``RanksDisagreeError`` rather than a silently different conversation.

Ctrl-C on rank 0 stops every rank at the same step: each ``should_stop`` call is an ``any_rank``
over the ranks' flags (one small ``all_sum`` per prefill chunk and per token). Each such step is
armed on the ``Watchdog``; waiting for the user's next message is not.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from models.processing.image_processor import ProcessedImage

from models.parallel.runtime import Watchdog, any_rank, describe, rank_errors, share_arrays, share_json

_IMAGE_FIELDS = ("num_soft_tokens", "height", "width", "source")


class RanksDisagreeError(RuntimeError):
    """The ranks generated different tokens for one turn (they must be running different software or hardware numerics)."""


def shared_seed(group: mx.distributed.Group, seed: int | None) -> int:
    """``seed``, or one rank 0 draws, the same on every rank."""
    return share_json(group, seed if seed is not None else random.randrange(2**31) if group.rank() == 0 else None)


def share_images(group: mx.distributed.Group, images: Sequence[ProcessedImage] | None) -> list[ProcessedImage]:
    """Rank 0's processed images on every rank (the others pass None)."""
    mine = images is not None
    fields = share_json(group, [{name: getattr(i, name) for name in _IMAGE_FIELDS} for i in images] if mine else None)
    arrays = share_arrays(group, [a for i in images for a in (i.patches, i.position_ids)] if mine else None)
    return [
        ProcessedImage(np.array(arrays[2 * n]), np.array(arrays[2 * n + 1]), **{k: f[k] for k in _IMAGE_FIELDS})
        for n, f in enumerate(fields)
    ]


class LeadSession:
    """Rank 0's ``ChatSession``, sharing each turn with the ranks that ``follow``; everything else
    (``messages``, ``last_stats``, ``model``, ...) is the wrapped session's."""

    _OWN = ("session", "group", "watchdog")

    def __init__(self, session, group: mx.distributed.Group, watchdog: Watchdog):
        self.session, self.group, self.watchdog = session, group, watchdog

    def __getattr__(self, name):
        return getattr(self.session, name)

    def __setattr__(self, name, value):
        if name not in self._OWN:  # e.g. a saved conversation loaded on rank 0 alone
            raise ValueError(f"with --parallel the chat's {name} cannot change on rank 0 alone")
        object.__setattr__(self, name, value)

    @property
    def cache(self):
        raise ValueError("with --parallel each rank holds only its part of the KV caches; they cannot be saved or loaded")

    def send(
        self, text: str, should_stop=lambda: False, images: Sequence = (), audio: Sequence = (), videos: Sequence = ()
    ) -> Iterator[str]:
        if audio or videos:
            raise ValueError("audio and video prompts are not split across ranks yet; run without --parallel for them")
        images = [i if isinstance(i, ProcessedImage) else self.session.model.process_images([i])[0] for i in images]
        with rank_errors(self.group):
            share_json(self.group, {"op": "send", "text": text})
            share_images(self.group, images)
        return turn(self.session, self.group, self.watchdog, text, images, should_stop)

    def reset(self) -> None:
        with rank_errors(self.group):
            share_json(self.group, {"op": "reset"})
        self.session.reset()

    def close(self) -> None:
        """Let the following ranks return from ``follow``."""
        with rank_errors(self.group):
            share_json(self.group, {"op": "quit"})


def follow(session, group: mx.distributed.Group, watchdog: Watchdog) -> None:
    """Run rank 0's turns on this rank's ``session`` until rank 0 closes its ``LeadSession``."""
    while True:
        with rank_errors(group):
            message = share_json(group)  # as long as the user takes: no watchdog here
            if message["op"] == "quit":
                return
            if message["op"] == "reset":
                session.reset()
                continue
            images = share_images(group, None)
        try:
            for _ in turn(session, group, watchdog, message["text"], images, lambda: False):
                pass
        except ValueError:
            pass  # rank 0 met the same refusal (a prompt past the context, ...) and reports it


def turn(session, group: mx.distributed.Group, watchdog: Watchdog, text: str, images, should_stop) -> Iterator[str]:
    """One ``ChatSession.send`` in step with the other ranks; their answers compared at the end."""

    def stop() -> bool:
        watchdog.arm("a chat turn")
        return any_rank(group, should_stop())

    with rank_errors(group):
        try:
            yield from session.send(text, should_stop=stop, images=images)
        finally:
            watchdog.disarm()
        stats = session.last_stats
        tokens = list(stats.tokens) if stats is not None else []
        digest = np.frombuffer(hashlib.sha256(np.array(tokens, dtype=np.int64).tobytes()).digest(), dtype=np.uint8)
        everyone = np.array(mx.distributed.all_gather(mx.array(digest[None]), group=group))
    if not (everyone == everyone[0]).all():
        different = [r for r in range(group.size()) if not (everyone[r] == everyone[0]).all()]
        raise RanksDisagreeError(f"{describe(group)}: ranks {different} generated other tokens than rank 0 in this turn")
