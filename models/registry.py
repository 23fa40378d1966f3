"""Which config parser, graph, key mapping and model object serve each checkpoint ``model_type``.

Every architecture is registered here the same way, DiffusionGemma included; ``models.loading``
has one loader for all of them. Families are imported lazily: one family's code never loads
another's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """How to build one family: parse its config, build its graph, load a checkpoint's arrays into
    it, and which user-facing object (``Model`` or ``DiffusionModel``) wraps the result."""

    parse_config: Callable[[Mapping[str, Any]], Any]
    build_graph: Callable[[Any], Any]
    load_weights: Callable[[Any, Mapping[str, Any]], None]
    wrapper: str = "autoregressive"  # or "diffusion", "unified" (Model with Gemma 4 unified's processors), "embedding"


class UnsupportedModelError(ValueError):
    """A checkpoint whose ``model_type`` the zoo does not run (the message lists what it runs)."""


# ---------------------------------------------------------------------------------------- weights
# Each family's key mapping (``weights.*_keys``) takes plain values read off the graph here.
def load_gemma4_text_weights(graph, weights) -> None:
    from weights.gemma4_keys import map_gemma4_text_weights
    from weights.modules import load_mapped, parameter_shapes

    config = graph.config
    reused = {i for i, mode in enumerate(config.kv_sharing_modes) if mode == "reuse"}
    mapped = map_gemma4_text_weights(weights, parameter_shapes(graph), tied=config.tie_word_embeddings, reused_layers=reused)
    load_mapped(graph, mapped, "gemma4 keys")


def load_gemma4_vision_weights(tower, embedder, weights) -> None:
    """A Gemma 4 vision tower and (unless None) its embedder, strictly from a checkpoint's arrays."""
    from weights.gemma4_vision_keys import map_gemma4_vision_weights
    from weights.modules import load_mapped, parameter_shapes

    embedder_shapes = None if embedder is None else parameter_shapes(embedder)
    mapped_tower, mapped_embedder = map_gemma4_vision_weights(
        weights, parameter_shapes(tower), embedder_shapes, clipped=tower.config.use_clipped_linears
    )
    load_mapped(tower, mapped_tower, "gemma4 vision keys")
    if embedder is not None:
        load_mapped(embedder, mapped_embedder, "gemma4 vision keys")


def load_gemma4_multimodal_weights(graph, weights) -> None:
    load_gemma4_text_weights(graph.language_model, weights)
    load_gemma4_vision_weights(graph.vision_tower, graph.embed_vision, weights)
    if graph.config.audio is not None:
        load_gemma4_audio_weights(graph.audio_tower, graph.embed_audio, weights)


def load_gemma4_audio_weights(tower, embedder, weights) -> None:
    """A Gemma 4 audio tower and its embedder, strictly from a checkpoint's arrays."""
    from weights.gemma4_audio_keys import map_gemma4_audio_weights
    from weights.modules import load_mapped, parameter_shapes

    mapped_tower, mapped_embedder = map_gemma4_audio_weights(
        weights, parameter_shapes(tower), parameter_shapes(embedder), clipped=tower.config.use_clipped_linears
    )
    load_mapped(tower, mapped_tower, "gemma4 audio keys")
    load_mapped(embedder, mapped_embedder, "gemma4 audio keys")


def load_gemma3_text_weights(graph, weights) -> None:
    from weights.gemma3_keys import map_gemma3_text_weights
    from weights.modules import load_mapped, parameter_shapes

    mapped = map_gemma3_text_weights(weights, parameter_shapes(graph), tied=graph.config.tie_word_embeddings)
    load_mapped(graph, mapped, "gemma3 keys")


def load_diffusion_gemma_weights(graph, weights) -> None:
    from weights.diffusion_gemma_keys import map_diffusion_gemma_weights
    from weights.modules import load_mapped, parameter_shapes

    vision = graph.config.vision
    clipped = None if vision is None else vision.use_clipped_linears
    load_mapped(graph, map_diffusion_gemma_weights(weights, parameter_shapes(graph), vision_clipped=clipped), "diffusion_gemma keys")


def load_gemma4_assistant_weights(graph, weights) -> None:
    from weights.gemma4_assistant_keys import map_gemma4_assistant_weights
    from weights.modules import load_mapped, parameter_shapes

    mapped = map_gemma4_assistant_weights(weights, parameter_shapes(graph), tied=graph.config.tie_word_embeddings)
    load_mapped(graph, mapped, "gemma4_assistant keys")


def _gemma4_assistant(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """A drafter for a Gemma 4 target (``models.generation.speculative``); it cannot generate alone."""
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from graphs.gemma4_assistant_config import Gemma4AssistantConfig

    return Architecture(Gemma4AssistantConfig.from_dict, Gemma4AssistantModel, load_gemma4_assistant_weights)


def _gemma4_unified_assistant(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """The Gemma 4 12B's drafter: a ``gemma4_assistant`` with the unified text defaults."""
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from graphs.gemma4_unified_config import unified_assistant_config

    return Architecture(unified_assistant_config, Gemma4AssistantModel, load_gemma4_assistant_weights)


def _gemma4_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    from graphs.gemma4_text import Gemma4TextModel
    from graphs.gemma4_text_config import Gemma4TextConfig

    return Architecture(Gemma4TextConfig.from_dict, Gemma4TextModel, load_gemma4_text_weights)


def _gemma4(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """Multimodal when the config has a vision_config *and* the weights a vision tower.

    mlx-lm's conversions keep Google's config (vision_config included) but drop the tower: they
    load as the text model they are.
    """
    from graphs.gemma4_multimodal_config import has_vision_config
    from weights.gemma4_multimodal_keys import has_vision_weights

    if not has_vision_config(config):
        return _gemma4_text(config, weight_names)
    if not has_vision_weights(weight_names):
        logger.info("gemma4 checkpoint without vision tower weights: loading the text model only")
        return _gemma4_text(config, weight_names)

    from graphs.gemma4_multimodal import Gemma4MultimodalModel
    from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig
    from weights.gemma4_audio_keys import has_audio_weights

    parse = Gemma4MultimodalConfig.from_dict
    if config.get("audio_config") and not has_audio_weights(weight_names):
        # A conversion that dropped the audio tower (mlx-vlm's text+vision ones): built without it,
        # so audio is refused by name (Model.supports_audio is False), never silently ignored.
        logger.info("gemma4 checkpoint with an audio_config but no audio tower weights: audio input is refused")
        parse = _without_audio
    return Architecture(parse, Gemma4MultimodalModel, load_gemma4_multimodal_weights)


def _without_audio(raw: Mapping[str, Any]):
    import dataclasses

    from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig

    return dataclasses.replace(Gemma4MultimodalConfig.from_dict(raw), audio=None)


def load_gemma4_unified_weights(graph, weights) -> None:
    """The text decoder through the Gemma 4 text mapping, the media embedders through their own."""
    from weights.gemma4_unified_keys import MEDIA_MODULES, map_gemma4_unified_media_weights, split_unified_weights
    from weights.modules import load_mapped, parameter_shapes

    text, media = split_unified_weights(weights)
    load_gemma4_text_weights(graph.language_model, text)
    modules = {name: graph[name] for name in MEDIA_MODULES if name in graph}
    mapped = map_gemma4_unified_media_weights(media, {name: parameter_shapes(m) for name, m in modules.items()})
    for name, module in modules.items():
        load_mapped(module, mapped[name], "gemma4_unified keys")


def _gemma4_unified(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """Gemma 4 12B: the text decoder with the vision and audio embedders its config declares.

    A conversion that dropped an embedder's weights while keeping its config part is built
    without that part, so its input is refused by name (``Model.supports_images`` /
    ``supports_audio`` are False), never silently ignored."""
    import dataclasses

    from graphs.gemma4_unified import Gemma4UnifiedModel
    from graphs.gemma4_unified_config import Gemma4UnifiedConfig
    from weights.gemma4_unified_keys import has_audio_weights, has_vision_weights

    drop = {}
    for part, present in (("vision", has_vision_weights(weight_names)), ("audio", has_audio_weights(weight_names))):
        if config.get(f"{part}_config") and not present:
            logger.info("gemma4_unified checkpoint with a %s_config but no %s embedder weights: %s input is refused", part, part, part)
            drop[part] = None

    def parse(raw: Mapping[str, Any]):
        return dataclasses.replace(Gemma4UnifiedConfig.from_dict(raw), **drop)

    return Architecture(parse, Gemma4UnifiedModel, load_gemma4_unified_weights, wrapper="unified")


def _gemma4_unified_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """``Gemma4UnifiedForCausalLM``: the 12B's text decoder alone (Gemma 4's text graph)."""
    from graphs.gemma4_text import Gemma4TextModel
    from graphs.gemma4_unified_config import unified_text_config

    return Architecture(unified_text_config, Gemma4TextModel, load_gemma4_text_weights)


def _gemma3_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """Gemma 3 text; with ``use_bidirectional_attention`` the encoder of an embedding model (EmbeddingGemma)."""
    from graphs.gemma3_text import Gemma3TextModel
    from graphs.gemma3_text_config import Gemma3TextConfig

    wrapper = "embedding" if config.get("use_bidirectional_attention") is True else "autoregressive"
    return Architecture(Gemma3TextConfig.from_dict, Gemma3TextModel, load_gemma3_text_weights, wrapper=wrapper)


def _diffusion_gemma(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    from graphs.diffusion_gemma import DiffusionGemmaModel
    from graphs.diffusion_gemma_config import DiffusionGemmaConfig

    return Architecture(DiffusionGemmaConfig.from_dict, DiffusionGemmaModel, load_diffusion_gemma_weights, wrapper="diffusion")


# model_type -> a function of (config.json dict, checkpoint key names) building its Architecture.
ARCHITECTURES: dict[str, Callable[[Mapping[str, Any], Collection[str]], Architecture]] = {
    "gemma4_text": _gemma4_text,
    "gemma4": _gemma4,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3_text,  # the text part of a multimodal Gemma 3 checkpoint
    "diffusion_gemma": _diffusion_gemma,
    "gemma4_assistant": _gemma4_assistant,
    "gemma4_unified": _gemma4_unified,
    "gemma4_unified_text": _gemma4_unified_text,
    "gemma4_unified_assistant": _gemma4_unified_assistant,
}


def architecture_for(config: Mapping[str, Any], source: str, weight_names: Collection[str]) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in {source}; the zoo runs: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type](config, weight_names)
