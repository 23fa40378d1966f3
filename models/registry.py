"""Which graph, config parser and key mapping serve each checkpoint ``model_type``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """How to build one family: parse its config, build its graph, load mapped weights into it."""

    parse_config: Callable[[Mapping[str, Any]], Any]
    build_graph: Callable[[Any], Any]
    load_weights: Callable[[Any, Mapping[str, Any]], None]


def _gemma4_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    from graphs.gemma4_text import Gemma4TextModel
    from weights.gemma4_keys import load_gemma4_text_weights

    from .gemma4_config import Gemma4TextConfig

    return Architecture(Gemma4TextConfig.from_dict, Gemma4TextModel, load_gemma4_text_weights)


def _gemma4(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """Multimodal when the config has a vision_config *and* the weights a vision tower.

    mlx-lm's conversions keep Google's config (vision_config included) but drop the tower: they
    load as the text model they are.
    """
    from weights.gemma4_multimodal_keys import has_vision_weights

    from .gemma4_multimodal_config import has_vision_config

    if not has_vision_config(config):
        return _gemma4_text(config, weight_names)
    if not has_vision_weights(weight_names):
        logger.info("gemma4 checkpoint without vision tower weights: loading the text model only")
        return _gemma4_text(config, weight_names)

    from graphs.gemma4_multimodal import Gemma4MultimodalModel
    from weights.gemma4_multimodal_keys import load_gemma4_multimodal_weights

    from .gemma4_multimodal_config import Gemma4MultimodalConfig

    return Architecture(Gemma4MultimodalConfig.from_dict, Gemma4MultimodalModel, load_gemma4_multimodal_weights)


# model_type -> a function of (config.json dict, checkpoint key names) building its Architecture
# (imported lazily: one family's code never loads another's).
def _gemma3_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    from graphs.gemma3_text import Gemma3TextModel, load_gemma3_text_weights

    from .gemma3_config import Gemma3TextConfig

    return Architecture(Gemma3TextConfig.from_dict, Gemma3TextModel, load_gemma3_text_weights)


ARCHITECTURES: dict[str, Callable[[Mapping[str, Any], Collection[str]], Architecture]] = {
    "gemma4_text": _gemma4_text,
    "gemma4": _gemma4,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3_text,  # the text part of a multimodal Gemma 3 checkpoint
}


def architecture_for(config: Mapping[str, Any], source: str, weight_names: Collection[str]) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {source}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type](config, weight_names)
