"""Every config in ``graphs/*_config.py`` refuses a wrongly typed or out-of-range field by name.

For each config a valid tiny ``config.json`` dict is taken, one field is replaced by a bad value
for its kind (a zero or negative size, a number written as a string, a bool where an int belongs,
a negative, zero, NaN or infinite epsilon or theta, an int where a flag belongs), and parsing must
raise a ``ValueError`` (``graphs.config.ConfigError``) whose message names the key. Without the
checks ``num_attention_heads: 0`` divided by zero in the graph, ``hidden_size: "64"`` was
accepted and a negative ``rms_norm_eps`` gave NaN logits.
"""

from __future__ import annotations

import copy
import math

import pytest

import graphs.diffusion_gemma_config as diffusion_module
import graphs.gemma4_text_config as gemma4_module
from graphs.config import BOOL, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, TEXT, ConfigError, read_fields, settings, text_section
from graphs.diffusion_gemma_config import DiffusionGemmaConfig
from graphs.gemma3_text_config import Gemma3TextConfig
from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig
from graphs.gemma4_text_config import Gemma4TextConfig
from graphs.gemma4_vision_config import Gemma4VisionConfig

S, F = "sliding_attention", "full_attention"
GEMMA4_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=4, layer_types=[S, S, S, F],
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, final_logit_softcapping=30.0,
    max_position_embeddings=512, rms_norm_eps=1e-6,
)  # fmt: skip
GEMMA3_TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=[S, S, F, S, S, F],
    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
)  # fmt: skip
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, patch_size=16, pooling_kernel_size=3, position_embedding_size=64,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)  # fmt: skip
DIFFUSION_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, sliding_window=4,
    layer_types=[S, S, S, F], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    use_bidirectional_attention="vision", pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip

# A bad value per kind: each must be refused, whatever the field.
BAD = {
    POSITIVE_INT: [0, -1, "64", 64.0, True, None, [64]],
    NON_NEGATIVE_INT: [-1, "0", 1.5, False, None],
    POSITIVE_FLOAT: [0, -1e-6, "1e-6", math.nan, math.inf, True, None],
    BOOL: ["yes", 1, 0, None],
    TEXT: [5, None],
}


def bad_values(kind):
    """The bad values of ``kind``, or of the kind it makes optional (``None`` then allowed)."""
    if kind in BAD:
        return BAD[kind]
    for base, values in BAD.items():
        if kind.expected == f"{base.expected} or null":
            return [v for v in values if v is not None]
    return ["?", 3.5]  # one_of(...)


def gemma4_text():
    return dict(GEMMA4_TEXT, model_type="gemma4_text")


def gemma4_nested():
    return {"model_type": "gemma4", "text_config": dict(GEMMA4_TEXT, model_type="gemma4_text")}


def gemma3_text():
    return dict(GEMMA3_TEXT, model_type="gemma3_text")


def gemma3_nested():
    return {"model_type": "gemma3", "text_config": dict(GEMMA3_TEXT)}


def vision():
    return dict(VISION, model_type="gemma4_vision")


def multimodal():
    return {
        "model_type": "gemma4", "text_config": dict(GEMMA4_TEXT), "vision_config": dict(VISION),
        "image_token_id": 301, "boi_token_id": 300, "eoi_token_id": 302,
    }  # fmt: skip


def diffusion():
    return {
        "model_type": "diffusion_gemma", "text_config": dict(DIFFUSION_TEXT, model_type="diffusion_gemma_text"),
        "vision_config": dict(VISION), "canvas_length": 8, "image_token_id": 251, "boi_token_id": 250, "eoi_token_id": 252,
    }  # fmt: skip


# DiffusionGemma drops these from its text config (transformers ignores them), so no value is refused.
DIFFUSION_IGNORED = set(diffusion_module._IGNORED_TEXT_FIELDS)


def kinds(cls):
    """``(name, kind)`` of every field ``cls`` reads from ``config.json``."""
    return [(name, kind) for name, (_, kind) in settings(cls).items()]


def cases():
    """(config class, base builder, path to the field, bad value) for every field of every config."""
    out = []

    def add(parse, base, path, kind):
        out.extend((parse, base, path, value) for value in bad_values(kind))

    for name, kind in kinds(Gemma4TextConfig):
        add(Gemma4TextConfig.from_dict, gemma4_text, (name,), kind)
        add(Gemma4TextConfig.from_dict, gemma4_nested, ("text_config", name), kind)
        add(Gemma4MultimodalConfig.from_dict, multimodal, ("text_config", name), kind)
        if name not in DIFFUSION_IGNORED:
            add(DiffusionGemmaConfig.from_dict, diffusion, ("text_config", name), kind)
    for name, kind in kinds(Gemma3TextConfig):
        add(Gemma3TextConfig.from_dict, gemma3_text, (name,), kind)
        add(Gemma3TextConfig.from_dict, gemma3_nested, ("text_config", name), kind)
    for name, kind in kinds(Gemma4VisionConfig):
        add(Gemma4VisionConfig.from_dict, vision, (name,), kind)
        add(Gemma4MultimodalConfig.from_dict, multimodal, ("vision_config", name), kind)
        add(DiffusionGemmaConfig.from_dict, diffusion, ("vision_config", name), kind)
    for name in ("image_token_id", "boi_token_id", "eoi_token_id"):
        for value in (-1, "301", 1.0, True, 10**6):  # 10**6: past the vocabulary
            out.append((Gemma4MultimodalConfig.from_dict, multimodal, (name,), value))
            out.append((DiffusionGemmaConfig.from_dict, diffusion, (name,), value))
    for value in (0, -8, "8", 8.0, None):
        out.append((DiffusionGemmaConfig.from_dict, diffusion, ("canvas_length",), value))
    for value in (0, -30.0, "30", math.nan):
        out.append((DiffusionGemmaConfig.from_dict, diffusion, ("text_config", "final_logit_softcapping"), value))
    for value in (-1, "1", [1, "2"], 1.5):
        out.append((DiffusionGemmaConfig.from_dict, diffusion, ("text_config", "eos_token_id"), value))
    # Nested numbers: RoPE thetas and fractions, per-layer geometry.
    for value in (0, -1.0, "1e6", math.nan, math.inf):
        out.append((Gemma3TextConfig.from_dict, gemma3_text, ("rope_theta",), value))
        out.append((Gemma3TextConfig.from_dict, gemma3_text, ("rope_local_base_freq",), value))
        out.append((Gemma4VisionConfig.from_dict, vision, ("rope_parameters", "rope_theta"), value))
        out.append((Gemma4TextConfig.from_dict, gemma4_text, ("rope_parameters", F, "rope_theta"), value))
    for value in (0, 1.5, -0.25, "0.25"):
        out.append((Gemma4TextConfig.from_dict, gemma4_text, ("rope_parameters", F, "partial_rotary_factor"), value))
    for value in (0, -1, "64", 64.5):
        out.append((Gemma4TextConfig.from_dict, gemma4_text, ("global_head_dim",), value))
        out.append((Gemma4TextConfig.from_dict, gemma4_text, ("per_layer_config", "3", "head_dim"), value))
        out.append((Gemma3TextConfig.from_dict, lambda: {k: v for k, v in gemma3_text().items() if k != "layer_types"},
                    ("sliding_window_pattern",), value))  # fmt: skip
    return out


def with_value(base: dict, path: tuple, value) -> dict:
    raw = copy.deepcopy(base)
    if path[0] == "rope_parameters" and "rope_parameters" not in raw and len(path) == 3:
        raw["rope_parameters"] = copy.deepcopy(gemma4_module.DEFAULT_ROPE_PARAMETERS)
    if path[0] == "per_layer_config":
        raw["per_layer_config"] = {}
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return raw


def case_id(case) -> str:
    parse, base, path, value = case
    return f"{parse.__self__.__name__}-{base.__name__}-{'.'.join(path)}={value!r}"


CASES = cases()


@pytest.mark.parametrize("parse, base", [
    (Gemma4TextConfig.from_dict, gemma4_text), (Gemma4TextConfig.from_dict, gemma4_nested),
    (Gemma3TextConfig.from_dict, gemma3_text), (Gemma3TextConfig.from_dict, gemma3_nested),
    (Gemma4VisionConfig.from_dict, vision), (Gemma4MultimodalConfig.from_dict, multimodal),
    (DiffusionGemmaConfig.from_dict, diffusion),
])  # fmt: skip
def test_the_valid_bases_parse(parse, base):
    parse(base())


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_bad_field_is_refused_by_name(case):
    parse, base, path, value = case
    with pytest.raises(ValueError) as info:
        parse(with_value(base(), path, value))
    assert path[-1] in str(info.value), f"{info.value} does not name {path[-1]!r}"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("num_attention_heads", 0, "num_attention_heads must be a positive int, got 0"),
        ("hidden_size", "64", "hidden_size must be a positive int, got '64' (str)"),
        ("rms_norm_eps", -1e-6, "rms_norm_eps must be a positive finite number, got -1e-06"),
    ],
)
@pytest.mark.parametrize("parse, base", [(Gemma4TextConfig.from_dict, gemma4_text), (Gemma3TextConfig.from_dict, gemma3_text)])
def test_the_reported_cases_name_key_value_and_expectation(parse, base, key, value, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        parse(with_value(base(), (key,), value))


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "head_dim", "sliding_window"])
@pytest.mark.parametrize("parse, base", [(Gemma4TextConfig.from_dict, gemma4_text), (Gemma3TextConfig.from_dict, gemma3_text)])
def test_sizes_past_32_bits_are_named(parse, base, key):
    """``hidden_size: 2**40`` was a bare ``OverflowError`` from MLX when the graph was built."""
    with pytest.raises(ConfigError, match=f"{key} is {2**40}; it must be below 2\\*\\*31"):
        parse(with_value(base(), (key,), 2**40))


# ------------------------------------------------------------------------------ sizes against the checkpoint
def saved_tiny(tmp_path_factory, name: str):
    """A tiny Gemma 4 text checkpoint (``hf_tiny.TEXT_CONFIGS[name]``) written by transformers."""
    pytest.importorskip("torch")
    from tests import hf_tiny

    folder = tmp_path_factory.mktemp("sizes") / name
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return saved_tiny(tmp_path_factory, "T1")


@pytest.fixture(scope="module")
def tiny_moe_folder(tmp_path_factory):
    return saved_tiny(tmp_path_factory, "T3")  # MoE beside the dense MLP


def with_config(source, target, **changes):
    """A copy of the checkpoint folder ``source`` whose config.json has ``changes`` (None deletes a key)."""
    import json
    import shutil

    shutil.copytree(source, target)
    raw = json.loads((target / "config.json").read_text())
    raw.update(changes)
    (target / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return target


@pytest.mark.parametrize("changes, words", [
    (dict(vocab_size=4096), "vocab_size is 4096, but the checkpoint's text weights hold 256 embedding rows"),
    (dict(hidden_size=128), "hidden_size is 128, but the checkpoint's text weights hold 64 values in the final norm"),
    (dict(num_attention_heads=8), "num_attention_heads is 8, but the checkpoint's text weights hold 4 heads of head_dim 32"),
    (dict(num_hidden_layers=6, layer_types=None), "num_hidden_layers is 6, but the checkpoint's text weights hold 4 layers"),
])  # fmt: skip
def test_sizes_past_what_the_weights_hold_are_named_before_the_graph_is_built(tiny_folder, tmp_path, monkeypatch, changes, words):
    import graphs.gemma4_text
    import models

    built = []
    monkeypatch.setattr(graphs.gemma4_text, "Gemma4TextModel", lambda config: built.append(config))
    with pytest.raises(ConfigError, match=words) as info:
        models.load(str(with_config(tiny_folder, tmp_path / "edited", **changes)))
    assert "config.json" in str(info.value) and not built


@pytest.mark.parametrize("changes, words", [
    (dict(intermediate_size=1 << 20), "intermediate_size is 1048576, but the checkpoint's text weights hold 128 rows in the widest MLP"),
    (dict(num_experts=4096), "num_experts is 4096, but the checkpoint's text weights hold 4 experts"),
    (dict(moe_intermediate_size=1 << 20), "moe_intermediate_size is 1048576, but the checkpoint's text weights hold 32 rows per expert"),
])  # fmt: skip
def test_mlp_and_expert_sizes_past_the_weights_are_named(tiny_moe_folder, tmp_path, monkeypatch, changes, words):
    import graphs.gemma4_text
    import models

    built = []
    monkeypatch.setattr(graphs.gemma4_text, "Gemma4TextModel", lambda config: built.append(config))
    with pytest.raises(ConfigError, match=words):
        models.load(str(with_config(tiny_moe_folder, tmp_path / "edited", **changes)))
    assert not built
    monkeypatch.undo()
    models.load(str(tiny_moe_folder))  # the sizes the weights hold load


def test_a_million_layers_is_refused_not_allocated(tmp_path):
    """The reported config: the graph's million layers ran the process out of memory (``std::bad_alloc``
    in ``nn.Linear``) before the missing weights were noticed. In a subprocess capped at 6 GiB, so
    that the unfixed loader fails the test instead of the machine."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    from tests.test_ids_and_tokenizers import save_tiny_gemma3

    gemma3 = save_tiny_gemma3(tmp_path / "gemma3", tokenizer=False)
    folder = with_config(gemma3, tmp_path / "million", num_hidden_layers=1_000_000, layer_types=None)
    script = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); import sys, models\n"
              "try:\n    models.load(sys.argv[1])\nexcept ValueError as err:\n    print(err); sys.exit(3)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "num_hidden_layers is 1000000, but the checkpoint's text weights hold 2 layers" in done.stdout


def test_sections_and_fields_helpers():
    assert text_section({"model_type": "gemma4_text", "a": 1}, "gemma4", "gemma4_text", "X") == {"model_type": "gemma4_text", "a": 1}
    assert text_section({"model_type": "gemma4"}, "gemma4", "gemma4_text", "X") == {}
    with pytest.raises(ConfigError, match="X: unsupported text_config model_type 'llama' inside gemma4"):
        text_section({"model_type": "gemma4", "text_config": {"model_type": "llama"}}, "gemma4", "gemma4_text", "X")
    with pytest.raises(ConfigError, match="X: unsupported model_type 'llama'"):
        text_section({"model_type": "llama"}, "gemma4", "gemma4_text", "X")
    with pytest.raises(ConfigError, match="text_config must be a JSON object"):
        text_section({"model_type": "gemma4", "text_config": [1]}, "gemma4", "gemma4_text", "X")
    assert read_fields({"n": 3}, {"n": 1, "eps": 1e-6}, {"n": POSITIVE_INT, "eps": POSITIVE_FLOAT}, "X") == {"n": 3, "eps": 1e-6}
    with pytest.raises(AssertionError, match="no kind declared"):
        read_fields({}, {"n": 1}, {}, "X")
