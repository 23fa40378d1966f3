"""How the MLX peers (mlx-lm, mlx-vlm) read a folder ``models.convert`` writes: the config keys they
need beyond transformers' form, and what they cannot run the same way.

Each registry entry (``models.registry.Architecture.peer``) names its reader and, for the Gemma
text families, the flat keys its parser derives (``graphs.*_config.mlx_lm_keys``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Peer:
    """What one family's converted folder needs for its MLX peer.

    ``parse`` reads the text config the keys are derived from; ``keys`` derives them from its
    result (None: nothing to add); ``nested``: the text fields sit under ``text_config`` (the
    top-level ``vocab_size`` is then written too, which mlx-lm's ``gemma4`` / ``gemma3`` classes
    copy over the text one); ``notes`` are the family's fixed remarks and ``text_notes`` those read
    off the written text fields."""

    reader: str = "mlx-lm"
    parse: Callable[[Mapping[str, Any]], Any] | None = None
    keys: Callable[[Any], dict[str, Any]] | None = None
    nested: bool = False
    notes: tuple[str, ...] = ()
    text_notes: Callable[[Mapping[str, Any]], list[str]] | None = None

    def rewrite(self, raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``raw`` plus the keys the reader needs. Keys are added only when absent, and only when
        ``parse`` reads the result as the same config. Returns the config and the added keys."""
        config = json.loads(json.dumps(raw))
        text = config.get("text_config") if self.nested else config
        if self.keys is None or not isinstance(text, dict):
            return config, []
        before = self.parse(config)
        extra = self.keys(before)
        added = [k for k in extra if text.get(k) is None]
        for k in added:
            text[k] = extra[k]
        if added and self.parse(config) != before:
            for k in added:
                del text[k]
            added = []
        if self.nested and config.get("vocab_size") is None:
            config["vocab_size"] = before.vocab_size
            added.append("vocab_size")
        return config, added

    def compatibility(self, config: Mapping[str, Any], added: list[str]) -> list[str]:
        """The model card's compatibility notes for the written ``config``."""
        notes = [f"Added for {self.reader} (same model in our loader): {', '.join(added)}."] if added else []
        notes += self.notes
        text = (config.get("text_config") if self.nested else config) or {}
        if text.get("attention_bias"):
            notes.append("attention_bias is set: mlx-lm's Gemma classes have no attention biases and cannot load this folder.")
        if text.get("use_bidirectional_attention") in ("all", True):
            notes.append(f"use_bidirectional_attention={text['use_bidirectional_attention']!r}: mlx-lm runs it causally (different outputs).")
        if self.text_notes is not None:
            notes += self.text_notes(text)
        return notes
