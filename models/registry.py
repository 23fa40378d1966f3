"""Which graph, config parser and key mapping serve each checkpoint ``model_type``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Architecture:
    """How to build one family: parse its config, build its graph, load mapped weights into it."""

    parse_config: Callable[[Mapping[str, Any]], Any]
    build_graph: Callable[[Any], Any]
    load_weights: Callable[[Any, Mapping[str, Any]], None]


def _gemma4_text() -> Architecture:
    from graphs.gemma4_text import Gemma4TextModel
    from weights.gemma4_keys import load_gemma4_text_weights

    from .gemma4_config import Gemma4TextConfig

    return Architecture(Gemma4TextConfig.from_dict, Gemma4TextModel, load_gemma4_text_weights)


# model_type -> a function building its Architecture (imported lazily: one family's code never
# loads another's).
ARCHITECTURES: dict[str, Callable[[], Architecture]] = {
    "gemma4_text": _gemma4_text,
    "gemma4": _gemma4_text,  # the text part of a multimodal checkpoint
}


def architecture_for(model_type: str | None, source: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {source}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]()
