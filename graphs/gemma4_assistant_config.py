"""The Gemma 4 assistant's configuration (transformers 5.24 ``Gemma4AssistantConfig``), parsed from ``config.json``.

An assistant (``google/gemma-4-*-it-assistant``, ``model_type: gemma4_assistant``) is a small Gemma 4
text decoder whose every layer reuses keys and values: the target's, through the cache's ``draft``
read. Its ``text_config`` is a ``gemma4_text`` config; the reference requires no per-layer inputs,
no MoE, no double-wide MLP and every layer KV-shared, and so does this parser. ``check_target``
refuses a target the assistant was not made for (hidden size, vocabulary, layer types, head
geometry) with a ``DrafterMismatchError`` naming what differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import BOOL, POSITIVE_INT, ConfigError, read_settings, setting
from graphs.gemma4_text_config import Gemma4TextConfig, LayerGeometry

OWNER = "Gemma4AssistantConfig"
MODEL_TYPE = "gemma4_assistant"

class DrafterMismatchError(ValueError):
    """A drafter that cannot draft for this target (the message names what differs)."""


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    """``text``: the decoder's ``Gemma4TextConfig``; the rest are the assistant's own fields."""

    text: Gemma4TextConfig
    backbone_hidden_size: int = setting(1536, POSITIVE_INT)
    use_ordered_embeddings: bool = setting(False, BOOL)
    num_centroids: int = setting(2048, POSITIVE_INT)
    centroid_intermediate_top_k: int = setting(32, POSITIVE_INT)
    tie_word_embeddings: bool = setting(True, BOOL)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4AssistantConfig":
        if not isinstance(raw, Mapping) or raw.get("model_type") != MODEL_TYPE:
            found = raw.get("model_type") if isinstance(raw, Mapping) else type(raw).__name__
            raise ConfigError(f"{OWNER}: expected model_type {MODEL_TYPE!r}, got {found!r}")
        text = raw.get("text_config")
        if not isinstance(text, Mapping) or text.get("model_type", "gemma4_text") != "gemma4_text":
            raise ConfigError(f"{OWNER}: text_config must be a gemma4_text config, got {text!r:.80}")
        text = dict(text, model_type="gemma4_text")
        fields = read_settings(raw, cls, OWNER)
        for name, allowed in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False), ("use_double_wide_mlp", False)):
            if text.get(name, allowed) != allowed:
                raise ConfigError(f"{OWNER}: text_config.{name} must be {allowed!r} in an assistant, got {text[name]!r}")
        layers = text.get("num_hidden_layers")
        shared = text.get("num_kv_shared_layers", 0)
        if shared not in (0, layers):
            # The reference sets 0 to every layer; anything else is refused by its validate_architecture.
            raise ConfigError(f"{OWNER}: every assistant layer reuses the target's keys and values: "
                              f"text_config.num_kv_shared_layers must be {layers} (or 0), got {shared!r}")
        # Parsed as a decoder whose layers own nothing; vocab_size_per_layer_input is unused without PLE.
        text = dict(text, num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=text.get("vocab_size", 1) or 1)
        text_config = Gemma4TextConfig.from_dict(text)
        if text_config.use_bidirectional_attention == "all":
            raise ConfigError(f"{OWNER}: text_config.use_bidirectional_attention='all' is not an assistant's")
        if fields["use_ordered_embeddings"]:
            C, K, V = fields["num_centroids"], fields["centroid_intermediate_top_k"], text_config.vocab_size
            if V % C:
                raise ConfigError(f"{OWNER}: vocab_size {V} is not a multiple of num_centroids {C}")
            if K > C:
                raise ConfigError(f"{OWNER}: centroid_intermediate_top_k {K} exceeds num_centroids {C}")
        return cls(text=text_config, **fields)

    # ------------------------------------------------------------------------------ derived
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def layers(self) -> tuple[LayerGeometry, ...]:
        """Every layer's geometry, all reusing keys and values (the target's)."""
        return tuple(dataclasses.replace(g, kv_sharing="reuse") for g in self.text.layers)

    def check_target(self, target: Any, name: str = "the target") -> dict[str, int]:
        """The target's cache index for each of the assistant's layer types: its last layer of
        that type that owns keys and values (what the reference's ``shared_kv_states`` hold).

        ``target`` is the target's ``Gemma4TextConfig`` (or a multimodal config with ``.text``).
        Raises ``DrafterMismatchError`` naming every difference: backbone hidden size, vocabulary,
        a layer type the target lacks, a head dim or kv head count other than the target layer's.
        """
        target = getattr(target, "text", target)
        if not isinstance(target, Gemma4TextConfig):
            raise DrafterMismatchError(
                f"a gemma4_assistant drafts for a Gemma 4 target, and {name} is a {type(target).__name__}; "
                "draft for it with a classic draft model instead"
            )
        if target.use_bidirectional_attention == "all":
            raise DrafterMismatchError(f"{name} attends bidirectionally ('all'): it does not generate, so nothing to draft for")
        problems = []
        if self.backbone_hidden_size != target.hidden_size:
            problems.append(f"backbone_hidden_size {self.backbone_hidden_size} != the target's hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {target.vocab_size}")
        types = set(self.text.layer_types)
        if "sliding_attention" in types and self.text.sliding_window != target.sliding_window:
            problems.append(f"sliding_window {self.text.sliding_window} != the target's {target.sliding_window}")
        donors = target.kv_donors
        for layer, geometry in enumerate(self.layers):
            donor = donors.get(geometry.layer_type)
            if donor is None:
                problems.append(f"layer {layer} is {geometry.layer_type} and the target has no such layer")
                continue
            D, Hkv = target.layer_head_dims[donor], target.layer_kv_heads[donor]
            if geometry.head_dim != D:
                problems.append(f"layer {layer} ({geometry.layer_type}) head_dim {geometry.head_dim} != {D} of target layer {donor}")
            if geometry.num_key_value_heads != Hkv:
                # The reference groups its query heads by its own kv head count over the target's keys.
                problems.append(
                    f"layer {layer} ({geometry.layer_type}) num_key_value_heads {geometry.num_key_value_heads} != "
                    f"{Hkv} of target layer {donor}"
                )
        if problems:
            raise DrafterMismatchError(f"this assistant was not made for {name}: " + "; ".join(problems))
        return {t: donors[t] for t in {g.layer_type for g in self.layers}}
