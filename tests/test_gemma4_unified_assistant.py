"""The Gemma 4 12B's drafter (``gemma4_unified_assistant``) against transformers' ``Gemma4UnifiedAssistantForCausalLM``.

It is a Gemma 4 assistant (``graphs.gemma4_assistant``) whose text config has the unified defaults;
its target is a unified model. For the same target state (a prompt longer than the sliding window,
reached through our caches in chunks, decode steps and a rollback), our draft logits must be within
1e-4 of the reference's (fp32, ``tests.assistant_tiny.reference_drafts``); speculative decoding
with it on a prompt holding an image and an audio clip must give plain greedy decoding's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402

from graphs.config import ConfigError  # noqa: E402
from graphs.gemma4_unified_config import unified_assistant_config  # noqa: E402
from tests.assistant_tiny import reference_drafts  # noqa: E402
from tests.hf_tiny import read_config  # noqa: E402
from tests.media_tiny import synthetic_clip  # noqa: E402
from tests.speculative_tiny import first_difference, run  # noqa: E402
from tests.test_gemma4_assistant import our_drafts  # noqa: E402
from tests.test_gemma4_unified import photo_like  # noqa: E402
from tests.unified_tiny import AUDIO, IMAGE, save_unified_assistant, save_unified_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("unified_assistant")
    hf_target = save_unified_model(root / "target")
    hf_assistant = save_unified_assistant(root / "assistant")
    target = models.load(str(root / "target"), tokenizer=False)
    target.generation_config = {}
    return root, hf_target, hf_assistant, target, models.load(str(root / "assistant"), tokenizer=False)


def test_drafter_logits_match_the_reference(pair):
    _, hf_target, hf_assistant, target, assistant = pair
    rng = np.random.default_rng(0)
    ids = [2] + rng.integers(3, 290, 18).tolist()
    token = int(rng.integers(3, 290))
    want, _ = reference_drafts(hf_target, hf_assistant, ids, token, k=4)
    for rollback in (0, 3):
        got = our_drafts(target.graph.language_model, assistant.graph, ids, token, 4, rollback=rollback)
        assert float(np.max(np.abs(got - want))) < TOL, f"rollback {rollback}"


def test_speculative_decoding_with_media_is_exact(pair):
    _, _, _, target, assistant = pair
    images = target.process_images([photo_like(100, 150, 0)], max_soft_tokens=70)
    prompt = target.prompt([2, 30, IMAGE, 31, AUDIO, 32, 33], images=images, audio=[synthetic_clip(0.4, seed=1)])
    want, _, _ = run(target, prompt, 40)
    for k in (1, 3, 6):
        got, stats, cache = run(target, prompt, 40, draft=assistant, num_draft_tokens=k)
        assert first_difference(got, want) is None, f"k={k}"
        assert cache[0].offset == len(prompt.ids) + 40 and stats.speculation.drafted > 0


def test_config_has_the_unified_defaults(pair):
    root, *_ = pair
    raw = read_config(root / "assistant")
    assert raw["model_type"] == "gemma4_unified_assistant"
    del raw["backbone_hidden_size"], raw["text_config"]["sliding_window"]
    config = unified_assistant_config(raw)
    assert config.backbone_hidden_size == 3840 and config.text.sliding_window == 1024
    with pytest.raises(ConfigError, match="gemma4_unified_text"):
        unified_assistant_config(dict(raw, text_config=dict(raw["text_config"], model_type="gemma4_text")))
