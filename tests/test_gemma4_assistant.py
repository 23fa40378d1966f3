"""The Gemma 4 assistant graph against transformers' ``Gemma4AssistantForCausalLM`` on tiny random checkpoints.

For the same target state (a prompt longer than the sliding window, so the drafter's window binds),
our drafter's logits at every draft step must be within 1e-4 of the reference's (fp32), with the
centroid-masked head and with the plain tied head, for targets with sliding + full layers, with
per-layer inputs and KV sharing, and with a MoE and K=V. The target state is reached through our
caches (chunked prefill + decode steps, and after a rollback); the reference recomputes it uncached.
A mismatched pair is a named error.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import models  # noqa: F401  (a fast BLAS before MLX)
import mlx.core as mx

from graphs.gemma4_assistant_config import DrafterMismatchError, Gemma4AssistantConfig
from tests import hf_tiny
from tests.assistant_tiny import reference_drafts, save_assistant

TOL = 1e-4
TARGETS = {
    "T1": dict(hf_tiny.TEXT_CONFIGS["T1"], global_head_dim=64),
    "T2": hf_tiny.TEXT_CONFIGS["T2"],  # PLE, KV sharing (donors are layers 0 and 1), softcap
    "T3": hf_tiny.TEXT_CONFIGS["T3"],  # MoE, K=V full layer
}

# The assistant's kv head counts per layer type are its target's (the reference groups by them).
ASSISTANT_HEADS = {"T3": dict(num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, config in TARGETS.items():
        root = tmp_path_factory.mktemp(name)
        target = hf_tiny.save_causal_lm(config, root / "target")
        heads = ASSISTANT_HEADS.get(name, {})
        ordered = save_assistant(config, root / "ordered", ordered=True, **heads)
        plain = save_assistant(config, root / "plain", ordered=False, seed=2, **heads)
        out[name] = (root, target, ordered, plain)
    return out


def load_assistant(directory):
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from models.registry import load_gemma4_assistant_weights

    graph = Gemma4AssistantModel(Gemma4AssistantConfig.from_dict(hf_tiny.read_config(directory)))
    load_gemma4_assistant_weights(graph, hf_tiny.read_safetensors(directory))
    return graph


def our_drafts(target, assistant, ids, token, k, chunk=7, rollback=0):
    """Our drafter's logits ``[k, V]`` after the target fed ``ids`` through its caches."""
    cache = target.make_cache()
    done = 0
    while done < len(ids) - 3:  # chunked prefill, then the last 3 as decode steps
        end = min(done + chunk, len(ids) - 3)
        target(mx.array([ids[done:end]]), cache)
        done = end
    for t in ids[done:-1]:
        target(mx.array([[t]]), cache)
    if rollback:
        # A verify block with wrong tokens, rolled back: the drafter must not see it.
        target(mx.array([[ids[-1]] + [5] * rollback]), cache)
        from cache import trim_cache

        assert trim_cache(cache, rollback + 1)
    _, hidden = target(mx.array([[ids[-1]]]), cache, with_hidden=True)
    assistant.pair(target.config)
    n = cache[0].offset
    assert n == len(ids)
    h, last, logits = hidden[:, -1:], mx.array([[token]]), []
    for _ in range(k):
        step_logits, h = assistant.step(target.embed(last), h, cache, n)
        logits.append(np.array(step_logits[0, -1]))
        last = mx.argmax(step_logits[:, -1:], axis=-1)
    return np.stack(logits)


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("head", ["ordered", "plain"])
def test_drafter_logits_match_the_reference(checkpoints, name, head):
    root, hf_target, hf_ordered, hf_plain = checkpoints[name]
    hf_assistant = hf_ordered if head == "ordered" else hf_plain
    target = hf_tiny.load_graph(root / "target")
    assistant = load_assistant(root / head)
    rng = np.random.default_rng(0)
    ids = [2] + rng.integers(3, 256, 18).tolist()
    token = int(rng.integers(3, 256))
    want, _ = reference_drafts(hf_target, hf_assistant, ids, token, k=4)
    for rollback in (0, 3):
        got = our_drafts(target, assistant, ids, token, 4, rollback=rollback)
        diff = float(np.max(np.abs(got - want)))
        assert diff < TOL, f"{name} {head} rollback {rollback}: max |diff| {diff}"


def test_the_sliding_window_plus_one_matters(checkpoints):
    """The test above would catch a drafter that saw only the target's own window on sliding layers."""
    root, hf_target, hf_ordered, _ = checkpoints["T1"]
    ids = list(range(3, 23))
    full, _ = reference_drafts(hf_target, hf_ordered, ids, 7, k=2)
    window = TARGETS["T1"]["sliding_window"]
    narrow, _ = reference_drafts(hf_target, hf_ordered, ids, 7, k=2, truncate_sliding=window)
    wide, _ = reference_drafts(hf_target, hf_ordered, ids, 7, k=2, truncate_sliding=window + 1)
    assert np.max(np.abs(full - wide)) < 1e-5
    assert np.max(np.abs(full - narrow)) > 1e-3


def test_loaded_by_model_type_and_paired_by_name(checkpoints, tmp_path):
    root, *_ = checkpoints["T1"]
    assistant = models.load(str(root / "ordered"), tokenizer=False)
    assert assistant.model_type == "gemma4_assistant"
    target = models.load(str(root / "target"), tokenizer=False)
    assistant.graph.pair(target.config)
    with pytest.raises(ValueError, match="does not generate on its own"):
        assistant.graph(mx.array([[1]]))
    # Another target: other hidden size, vocabulary and sliding window, each named.
    other = dict(TARGETS["T1"], hidden_size=48, vocab_size=320, sliding_window=6)
    raw = json.loads((root / "ordered" / "config.json").read_text())
    config = Gemma4AssistantConfig.from_dict(raw)
    from graphs.gemma4_text_config import Gemma4TextConfig

    with pytest.raises(DrafterMismatchError, match=r"backbone_hidden_size 64 != the target's hidden_size 48.*vocab_size 256 != the target's 320.*sliding_window 4 != the target's 6"):
        config.check_target(Gemma4TextConfig.from_dict(dict(other, model_type="gemma4_text")))
    only_full = dict(TARGETS["T1"], layer_types=["full_attention"] * 4, model_type="gemma4_text")
    with pytest.raises(DrafterMismatchError, match="sliding_attention and the target has no such layer"):
        config.check_target(Gemma4TextConfig.from_dict(only_full))
    with pytest.raises(DrafterMismatchError, match="Gemma 4 target"):
        config.check_target(object(), "a Gemma 3 model")


def test_assistant_configs_the_reference_refuses_are_refused():
    from graphs.gemma4_assistant_config import ConfigError

    base = {"model_type": "gemma4_assistant", "backbone_hidden_size": 64,
            "text_config": dict(hf_tiny.BASE, model_type="gemma4_text", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                hidden_size_per_layer_input=0)}  # fmt: skip
    Gemma4AssistantConfig.from_dict(base)
    for key, value in (("hidden_size_per_layer_input", 16), ("enable_moe_block", True), ("num_kv_shared_layers", 1)):
        bad = dict(base, text_config=dict(base["text_config"], **{key: value}))
        with pytest.raises(ConfigError, match=key):
            Gemma4AssistantConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="num_centroids"):
        Gemma4AssistantConfig.from_dict(dict(base, use_ordered_embeddings=True, num_centroids=7))
