"""A cache list made for another model is refused by name before any read, and left untouched.

Same number of layers but other layer types, another window, or other KV sharing used to give
wrong logits silently (or a raw ``TypeError``); every graph now checks its cache list against its
own layers (``graphs.layers.CheckedCaches`` -> ``cache.check_caches``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache import quantize_caches
from graphs import Gemma4TextModel
from graphs.gemma3_text import Gemma3TextModel
from graphs.gemma3_text_config import Gemma3TextConfig
from graphs.gemma4_text_config import Gemma4TextConfig

S, F = "sliding_attention", "full_attention"
BASE = dict(
    model_type="gemma4_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32, sliding_window=4,
    hidden_size_per_layer_input=0,
)  # fmt: skip


def gemma4(**changes) -> Gemma4TextModel:
    return Gemma4TextModel(Gemma4TextConfig.from_dict({**BASE, **changes}))


IDS = mx.array([[3, 5, 7, 9]])


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(layer_types=[F, S, S, F]), "layer 0 expects a sliding"),
        (dict(layer_types=[S, S, F, F], sliding_window=5), "layer 0 expects a sliding (window 4)"),
        (dict(layer_types=[S, F, S, F], num_kv_shared_layers=2), "layer 1 expects a sliding"),
        (dict(layer_types=[S, S, F], num_hidden_layers=3), "cache has 4 entries for 3 layers"),
    ],
)
def test_a_cache_of_another_gemma4_is_refused_and_left_as_it_was(other, message):
    owner = gemma4(layer_types=[S, S, F, F])
    if "num_hidden_layers" in other:  # the model is the shorter one here
        owner, foreign = gemma4(**other), owner.make_cache()
    else:
        foreign = gemma4(**other).make_cache()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        owner(IDS, cache=foreign)
    assert all(c.offset == 0 for c in foreign)


def test_sharing_that_differs_is_a_named_error_not_a_type_error():
    shared = gemma4(layer_types=[S, F, S, F], num_kv_shared_layers=2)
    plain = gemma4(layer_types=[S, F, S, F])
    with pytest.raises(ValueError, match="layer 2 expects a shared view of layer 0"):
        shared(IDS, cache=plain.make_cache())
    with pytest.raises(ValueError, match="layer 2 expects a sliding"):
        plain(IDS, cache=shared.make_cache())


def test_own_and_quantized_caches_pass():
    model = gemma4(layer_types=[S, F, S, F], num_kv_shared_layers=2)
    cache = model.make_cache()
    model(IDS, cache=cache)
    quantize_caches(cache, bits=8, group_size=32)
    assert model(mx.array([[11]]), cache=cache).shape == (1, 1, 64)


def test_gemma3_refuses_a_gemma4_cache_of_other_windows():
    g3 = Gemma3TextModel(Gemma3TextConfig.from_dict(dict(
        model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8, layer_types=[S, S, F, F],
    )))  # fmt: skip
    with pytest.raises(ValueError, match="Gemma3TextModel: layer 0 expects a sliding \\(window 8\\)"):
        g3(IDS, cache=gemma4(layer_types=[S, S, F, F]).make_cache())
