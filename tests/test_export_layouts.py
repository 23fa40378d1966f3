"""Each registry entry's export layout (``weights.layouts`` and the families' own, beside their import
mappings) round-trips through its import mapping: a tiny checkpoint saved by transformers, loaded,
written back under the layout and loaded again gives every parameter bit for bit, and the written
key set resolves to the same architecture (a multimodal export is read back as multimodal)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.loading import load_graph  # noqa: E402
from models.registry import architecture_for  # noqa: E402
from tests import assistant_tiny, diffusion_tiny, hf_tiny, unified_tiny  # noqa: E402
from tests.test_distributed_gemma3 import CONFIG as GEMMA3  # noqa: E402
from weights import read_config  # noqa: E402


def _gemma3(folder):
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)).save_pretrained(folder)


SAVERS = {
    "gemma3_text": _gemma3,
    "gemma4_text_moe": lambda folder: hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T3"], folder),
    "gemma4_text_shared_kv": lambda folder: hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T2"], folder),
    "gemma4_multimodal": hf_tiny.save_conditional_generation,
    "diffusion_gemma": lambda folder: diffusion_tiny.save_diffusion("T7", folder),
    "gemma4_assistant": lambda folder: assistant_tiny.save_assistant(hf_tiny.TEXT_CONFIGS["T1"], folder),
    "gemma4_unified": unified_tiny.save_unified_model,
}


def nested(raw: dict) -> dict:
    """A text config as the text part of its multimodal family's config (``gemma3`` / ``gemma4``)."""
    return {"model_type": raw["model_type"].removesuffix("_text"), "text_config": raw}


def round_trip(raw: dict, graph) -> None:
    source = dict(tree_flatten(graph.parameters()))
    architecture = architecture_for(raw, "config.json", source)
    written = architecture.export_layout().export(source)
    again = architecture_for(raw, "config.json", written)
    fresh = again.build_graph(again.parse_config(raw))
    again.load_weights(fresh, written)
    assert type(fresh) is type(graph)
    back = dict(tree_flatten(fresh.parameters()))
    assert sorted(back) == sorted(source)
    for name, value in source.items():
        assert mx.array_equal(back[name], value), name


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_import_of_export_is_identity(family, tmp_path):
    SAVERS[family](tmp_path)
    raw = read_config(tmp_path)
    loaded = load_graph(tmp_path, dtype=None)
    round_trip(raw, loaded.graph)
    if raw["model_type"] in ("gemma3_text", "gemma4_text"):  # the same text model under mlx-lm's nested layout
        round_trip(nested(raw), loaded.graph)
