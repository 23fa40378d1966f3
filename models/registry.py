"""Everything the zoo knows about each checkpoint ``model_type``: one ``Architecture`` record per family.

Every architecture is registered here the same way, DiffusionGemma included. ``models.loading``
builds and loads the graph from the record, ``models.convert`` writes it back in the record's key
layout and peer config, ``models.parallel`` splits it by the record's decoder shape. Families are
imported lazily: one family's code never loads another's. ``docs/adding_a_model.md`` walks
through adding one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

from models.peers import Peer

logger = logging.getLogger(__name__)

PARALLEL_MODES = ("tensor", "pipeline")


@dataclass(frozen=True)
class DecoderShape:
    """What the parallel plans (``models.parallel``) read of a family's text decoder, per layer where
    layers differ. ``first_kv_donor``: the first layer whose keys and values a later layer reads
    (None without KV sharing); ``refused``: plan -> why this config cannot run under it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    kv_heads: tuple[int, ...]
    intermediate_sizes: tuple[int, ...]
    reuses_kv: tuple[bool, ...]
    first_kv_donor: int | None = None
    per_layer_input: int = 0  # Gemma 4's hidden_size_per_layer_input (0: none)
    vocab_size_per_layer_input: int = 0
    num_experts: int = 0  # MoE beside the dense MLP (0: none)
    moe_intermediate_size: int = 0
    split_vocabulary: bool = True  # False: the embedding table stays whole on every rank
    refused: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Architecture:
    """One family: parse its config, build its graph, load a checkpoint's arrays into it
    (``load_weights``, through ``weights.*_keys``) and write them back (``export_layout``, the
    mirror in ``weights``), what its MLX peer needs (``peer``), how it splits across ranks
    (``decoder_shape``; None: not split), its media processors' settings family
    (``models.processing.settings``; None: text only) and which generation loop wraps it
    (``Model`` for ``"autoregressive"``, ``DiffusionModel`` for ``"diffusion"``, ``EmbeddingModel``
    for ``"embedding"``: an encoder with no generation loop)."""

    parse_config: Callable[[Mapping[str, Any]], Any]
    build_graph: Callable[[Any], Any]
    load_weights: Callable[[Any, Mapping[str, Any]], None]
    export_layout: Callable[[], Any]
    peer: Peer = Peer()
    decoder_shape: Callable[[Any], DecoderShape] | None = None
    processors: str | None = None
    generation: str = "autoregressive"


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


# ---------------------------------------------------------------------------------------- parallel shapes
def gemma4_decoder_shape(config) -> DecoderShape:
    """A Gemma 4 text decoder's shape (the text part of a multimodal config)."""
    text = getattr(config, "text", config)
    layers = text.layers
    refused = {}
    if text.use_bidirectional_attention == "all":
        refused["pipeline"] = "a use_bidirectional_attention='all' encoder has no generation to pipeline"
    return DecoderShape(
        hidden_size=text.hidden_size, num_hidden_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
        vocab_size=text.vocab_size, kv_heads=tuple(g.num_key_value_heads for g in layers),
        intermediate_sizes=tuple(g.intermediate_size for g in layers), reuses_kv=tuple(g.reuses_kv for g in layers),
        first_kv_donor=min(text.kv_donors.values()) if text.num_kv_shared_layers else None,
        per_layer_input=text.hidden_size_per_layer_input, vocab_size_per_layer_input=text.vocab_size_per_layer_input,
        num_experts=text.num_experts if text.enable_moe_block else 0, moe_intermediate_size=text.moe_intermediate_size,
        refused=refused,
    )  # fmt: skip


def diffusion_gemma_decoder_shape(config) -> DecoderShape:
    """DiffusionGemma's stack: Gemma 4's, with the embedding table whole (its self-conditioning
    multiplies by the whole table) and no pipeline (a denoising step is not a layer-by-layer decode)."""
    import dataclasses

    refused = {"pipeline": "DiffusionGemma runs tensor-parallel only (--parallel tensor)"}
    return dataclasses.replace(gemma4_decoder_shape(config), split_vocabulary=False, refused=refused)


def gemma3_decoder_shape(config) -> DecoderShape:
    """A Gemma 3 text decoder: every layer alike, no KV sharing, no per-layer inputs, no MoE."""
    L = config.num_hidden_layers
    return DecoderShape(
        hidden_size=config.hidden_size, num_hidden_layers=L, num_attention_heads=config.num_attention_heads,
        vocab_size=config.vocab_size, kv_heads=(config.num_key_value_heads,) * L,
        intermediate_sizes=(config.intermediate_size,) * L, reuses_kv=(False,) * L,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- peers
def _gemma4_peer(nested: bool, parse=None, reader: str = "mlx-lm", notes: tuple[str, ...] = ()) -> Peer:
    from graphs.gemma4_text_config import Gemma4TextConfig, mlx_lm_keys

    return Peer(reader, parse or Gemma4TextConfig.from_dict, mlx_lm_keys, nested, notes)


def _gemma3_peer(nested: bool) -> Peer:
    from graphs.gemma3_text_config import Gemma3TextConfig, mlx_lm_keys

    return Peer("mlx-lm", Gemma3TextConfig.from_dict, mlx_lm_keys, nested, text_notes=_gemma3_notes)


def _gemma3_notes(text: Mapping[str, Any]) -> list[str]:
    notes = []
    if text.get("final_logit_softcapping"):
        notes.append("final_logit_softcapping is set: mlx-lm's gemma3_text does not apply it (different outputs).")
    if text.get("sliding_window_pattern") is None:
        notes.append("layer_types has no fixed period: mlx-lm's gemma3_text cannot place the full-attention layers.")
    return notes


# ---------------------------------------------------------------------------------------- families
def _gemma4_assistant(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """A drafter for a Gemma 4 target (``models.generation.speculative``); it cannot generate alone."""
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from graphs.gemma4_assistant_config import Gemma4AssistantConfig
    from weights.layouts import causal_lm_layout

    return Architecture(Gemma4AssistantConfig.from_dict, Gemma4AssistantModel, load_gemma4_assistant_weights, causal_lm_layout)


def _gemma4_unified_assistant(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """The Gemma 4 12B's drafter: a ``gemma4_assistant`` with the unified text defaults."""
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from graphs.gemma4_unified_config import unified_assistant_config
    from weights.layouts import causal_lm_layout

    return Architecture(unified_assistant_config, Gemma4AssistantModel, load_gemma4_assistant_weights, causal_lm_layout)


def _gemma4_text(config: Mapping[str, Any], weight_names: Collection[str], nested: bool = False, notes=()) -> Architecture:
    """Gemma 4's text decoder; ``nested``: the text part of a ``gemma4`` config (mlx-lm's ``gemma4``
    layout), ``notes``: the model card's remarks on it."""
    from graphs.gemma4_text import Gemma4TextModel
    from graphs.gemma4_text_config import Gemma4TextConfig
    from weights.layouts import causal_lm_layout, nested_text_layout

    return Architecture(
        Gemma4TextConfig.from_dict, Gemma4TextModel, load_gemma4_text_weights,
        nested_text_layout if nested else causal_lm_layout, _gemma4_peer(nested, notes=notes), gemma4_decoder_shape,
    )  # fmt: skip


def _gemma4(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """Multimodal when the config has a vision_config *and* the weights a vision tower.

    mlx-lm's conversions keep Google's config (vision_config included) but drop the tower: they
    load as the text model they are.
    """
    from graphs.gemma4_multimodal_config import has_vision_config
    from weights.gemma4_multimodal_keys import has_vision_weights

    if not has_vision_config(config):
        return _gemma4_text(config, weight_names, nested=True)
    if not has_vision_weights(weight_names):
        logger.info("gemma4 checkpoint without vision tower weights: loading the text model only")
        return _gemma4_text(config, weight_names, nested=True, notes=_GEMMA4_VISION_NOTES)

    from graphs.gemma4_multimodal import Gemma4MultimodalModel
    from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig
    from weights.gemma4_audio_keys import has_audio_weights
    from weights.gemma4_multimodal_keys import multimodal_layout

    parse = Gemma4MultimodalConfig.from_dict
    if config.get("audio_config") and not has_audio_weights(weight_names):
        # A conversion that dropped the audio tower (mlx-vlm's text+vision ones): built without it,
        # so audio is refused by name (Model.supports_audio is False), never silently ignored.
        logger.info("gemma4 checkpoint with an audio_config but no audio tower weights: audio input is refused")
        parse = _without_audio
    return Architecture(
        parse, Gemma4MultimodalModel, load_gemma4_multimodal_weights, multimodal_layout,
        _gemma4_peer(True, notes=_GEMMA4_VISION_NOTES), gemma4_decoder_shape, processors="gemma4",
    )  # fmt: skip


_GEMMA4_VISION_NOTES = (
    "mlx-lm loads the text model of this folder (it drops the vision tower); mlx-vlm's gemma4 reads the "
    "whole layout (not tested here: mlx-vlm is not installed).",
)


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
    from graphs.gemma4_unified_config import Gemma4UnifiedConfig, unified_text_config
    from weights.gemma4_multimodal_keys import multimodal_layout
    from weights.gemma4_unified_keys import has_audio_weights, has_vision_weights

    drop = {}
    for part, present in (("vision", has_vision_weights(weight_names)), ("audio", has_audio_weights(weight_names))):
        if config.get(f"{part}_config") and not present:
            logger.info("gemma4_unified checkpoint with a %s_config but no %s embedder weights: %s input is refused", part, part, part)
            drop[part] = None

    def parse(raw: Mapping[str, Any]):
        return dataclasses.replace(Gemma4UnifiedConfig.from_dict(raw), **drop)

    return Architecture(
        parse, Gemma4UnifiedModel, load_gemma4_unified_weights, multimodal_layout,
        _gemma4_peer(True, unified_text_config, "mlx-vlm", _UNIFIED_NOTES), processors="gemma4_unified",
    )  # fmt: skip


_UNIFIED_NOTES = (
    "mlx-lm has no gemma4_unified; mlx-vlm 0.7.10's gemma4_unified loads this folder (checked by hand, "
    "docs/unified.md; not in the tests: mlx-vlm is not installed).",
)


def _gemma4_unified_text(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """``Gemma4UnifiedForCausalLM``: the 12B's text decoder alone (Gemma 4's text graph)."""
    from graphs.gemma4_text import Gemma4TextModel
    from graphs.gemma4_unified_config import unified_text_config
    from weights.layouts import causal_lm_layout

    return Architecture(
        unified_text_config, Gemma4TextModel, load_gemma4_text_weights, causal_lm_layout,
        _gemma4_peer(False, unified_text_config),
    )  # fmt: skip


def _gemma3_text(config: Mapping[str, Any], weight_names: Collection[str], nested: bool = False) -> Architecture:
    """Gemma 3's text decoder; ``nested``: the text part of a multimodal ``gemma3`` config (mlx-lm's ``gemma3`` layout).
    With ``use_bidirectional_attention`` it is the encoder of an embedding model (EmbeddingGemma): no generation
    loop, not split over ranks."""
    from graphs.gemma3_text import Gemma3TextModel
    from graphs.gemma3_text_config import Gemma3TextConfig
    from weights.layouts import causal_lm_layout, nested_text_layout

    if config.get("use_bidirectional_attention") is True:
        return Architecture(
            Gemma3TextConfig.from_dict, Gemma3TextModel, load_gemma3_text_weights, causal_lm_layout,
            _gemma3_peer(False), None, generation="embedding",
        )  # fmt: skip
    return Architecture(
        Gemma3TextConfig.from_dict, Gemma3TextModel, load_gemma3_text_weights,
        nested_text_layout if nested else causal_lm_layout, _gemma3_peer(nested), gemma3_decoder_shape,
    )  # fmt: skip


def _gemma3(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    """The text part of a multimodal Gemma 3 checkpoint."""
    return _gemma3_text(config, weight_names, nested=True)


def _diffusion_gemma(config: Mapping[str, Any], weight_names: Collection[str]) -> Architecture:
    from graphs.diffusion_gemma import DiffusionGemmaModel
    from graphs.diffusion_gemma_config import DiffusionGemmaConfig
    from weights.diffusion_gemma_keys import DiffusionLayout

    peer = Peer("mlx-vlm", notes=(
        "mlx-lm has no DiffusionGemma; mlx-vlm's diffusion_gemma reads this layout (not tested here: mlx-vlm is not installed).",
    ))  # fmt: skip
    return Architecture(
        DiffusionGemmaConfig.from_dict, DiffusionGemmaModel, load_diffusion_gemma_weights, DiffusionLayout, peer,
        diffusion_gemma_decoder_shape, processors="gemma4", generation="diffusion",
    )  # fmt: skip


# model_type -> a function of (config.json dict, checkpoint key names) building its Architecture.
ARCHITECTURES: dict[str, Callable[[Mapping[str, Any], Collection[str]], Architecture]] = {
    "gemma4_text": _gemma4_text,
    "gemma4": _gemma4,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,
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
