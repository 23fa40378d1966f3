"""Export key layouts: our graph's parameter names -> the keys a written checkpoint uses.

The mirror of the import mappings (``weights.*_keys``), which accept these layouts among others:
``models.convert`` writes a checkpoint through the layout its architecture's registry entry names
(``models.registry``), so the MLX peers (mlx-lm, mlx-vlm) read the folder with their own classes.
"""

from __future__ import annotations

from typing import Callable, Mapping

import mlx.core as mx


class Layout:
    """Our graph's parameter names -> the written checkpoint's keys (and module paths)."""

    def __init__(self, key: Callable[[str], str]):
        self._key = key

    def key(self, name: str) -> str:
        return self._key(name)

    def module_path(self, path: str) -> str:
        return self.key(path + ".weight").removesuffix(".weight")

    def export(self, params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        return {self.key(name): value for name, value in params.items()}


def prefixed(text_prefix: str, head_prefix: str, graph_prefix: str = "") -> Layout:
    """``graph_prefix + X`` -> ``text_prefix + X`` (``lm_head.*`` -> ``head_prefix + *``); other names unchanged."""

    def key(name: str) -> str:
        if not name.startswith(graph_prefix):
            return name
        inner = name[len(graph_prefix) :]
        if inner.startswith("lm_head."):
            return head_prefix + inner[len("lm_head.") :]
        return text_prefix + inner

    return Layout(key)


def causal_lm_layout() -> Layout:
    """mlx-lm's text layout (``gemma4_text``, ``gemma3_text``; transformers' ``*ForCausalLM``): ``model.*``, ``lm_head.*``."""
    return prefixed("model.", "lm_head.")


def nested_text_layout() -> Layout:
    """The text model of a multimodal config as mlx-lm's ``gemma4`` / ``gemma3`` read it: ``language_model.model.*``."""
    return prefixed("language_model.model.", "language_model.lm_head.")
