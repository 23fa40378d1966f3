"""``python -m examples.image_to_text`` end to end: a tiny random multimodal Gemma 4 with the real
tokenizer, real photos, the answer compared with the same request made in Python."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import models  # noqa: E402
from models.generation.chat import ChatSession  # noqa: E402
from tests.test_gemma4_multimodal_chat import build_chat_checkpoint, real_photos  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_chat_checkpoint(tmp_path_factory.mktemp("tiny-gemma4-vision-demo"))


def run_demo(*args, stdin: str | None = None):
    return subprocess.run(
        [sys.executable, "-m", "examples.image_to_text", *map(str, args)], input=stdin, capture_output=True, text=True
    )


def test_two_photos_and_a_question(checkpoint):
    photos = real_photos()
    images = [photos["chelsea.png"], photos["grace_hopper.jpg"]]
    out = run_demo("--model", checkpoint, "--image", *images, "--prompt", "What do these have in common?",
                   "--max-soft-tokens", 70, "--max-tokens", 12, "--verbose")  # fmt: skip
    assert out.returncode == 0, out.stderr
    session = ChatSession(models.load(str(checkpoint)), max_tokens=12, max_soft_tokens=70)
    expected = "".join(session.send("What do these have in common?", images=images))
    text, stats = out.stdout.rsplit("\n[vision: 2 images", 1)
    assert text == expected
    assert f"prompt: {session.last_stats.prompt_tokens} tokens" in stats
    assert session.last_stats.prompt_tokens > 2 * 40  # both images' soft tokens are in the prompt


def test_default_prompt_from_stdin_and_bad_inputs(checkpoint, tmp_path):
    photo = real_photos()["coffee.png"]
    out = run_demo("--model", checkpoint, "--image", photo, "--prompt", "-", "--max-soft-tokens", 70, "--max-tokens", 4,
                   stdin="Describe it.")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and len(out.stdout) > 1

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = run_demo("--model", checkpoint, "--image", photo, broken)
    assert out.returncode == 2 and f"cannot read image '{broken}'" in out.stderr

    out = run_demo("--model", checkpoint.parent, "--image", photo)  # a folder without a checkpoint
    assert out.returncode == 2 and out.stderr == f"error: {checkpoint.parent} has no config.json, so it is not a model checkpoint folder.\n"

    out = run_demo("--model", checkpoint, "--image", photo, "--max-soft-tokens", 100)
    assert out.returncode == 2 and "invalid choice: 100" in out.stderr
