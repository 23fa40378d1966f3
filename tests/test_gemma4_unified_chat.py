"""Gemma 4 unified in the chat and the media demo: a tiny random checkpoint with the released vocabulary,
the real Gemma 4 tokenizer and chat template, real photos, the real recording and a real video.

The template's placeholders (``<|image|>`` 258880, ``<|audio|>`` 258881, ``<|video|>`` 258884) are
the model's own ids here. A real photo through the template must give transformers' logits; the
terminal chat attaches an image, a clip and a video with ``/image``, ``/audio`` and ``/video`` and
answers as the same request made in Python; ``examples.image_to_text`` takes all three at once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pexpect = pytest.importorskip("pexpect")

import models  # noqa: E402
from models.assets.fetch import AssetFetchError  # noqa: E402
from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir  # noqa: E402
from models.generation.chat import ChatSession  # noqa: E402
from tests.test_gemma4_multimodal_chat import real_photos  # noqa: E402
from tests.unified_tiny import UNIFIED_AUDIO, UNIFIED_TEXT, UNIFIED_VISION, hf_inputs, randomize  # noqa: E402

pytestmark = pytest.mark.slow

BUDGET = 70
IDS = dict(image_token_id=258880, audio_token_id=258881, video_token_id=258884)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny unified model with the released vocabulary and ids, tokenizer files and stop ids."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny-gemma4-unified-chat")
    torch.manual_seed(5)
    text = dict(UNIFIED_TEXT, vocab_size=262144, sliding_window=8, initializer_range=0.05)
    config = Gemma4UnifiedConfig(text_config=text, vision_config=UNIFIED_VISION, audio_config=UNIFIED_AUDIO)
    reference = Gemma4UnifiedForConditionalGeneration(config).eval()
    randomize(reference, seed=6)
    reference.save_pretrained(folder)
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    return folder, reference


@pytest.fixture(scope="module")
def model(checkpoint):
    return models.load(str(checkpoint[0]))


@pytest.fixture(scope="module")
def media():
    from tests.real_media import fetch_media

    try:
        found = fetch_media(["lena.wav", "carphone_pristine.mp4"])
    except AssetFetchError as exc:
        pytest.skip(f"could not download the media: {exc}")
    return real_photos()["chelsea.png"], found["lena.wav"], found["carphone_pristine.mp4"]


def test_a_real_photo_and_clip_in_a_chat_prompt_equal_transformers(checkpoint, model, media):
    from models.processing.audio import load_audio

    _, reference = checkpoint
    photo, clip, _ = media
    session = ChatSession(model)
    content = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What is this?"}]
    images = model.process_images([photo], BUDGET)
    samples, _ = load_audio(str(clip))
    prompt = model.media_prompt(session.render([{"role": "user", "content": content}]), images=images, audio=[samples])
    assert prompt.ids.count(IDS["image_token_id"]) == images[0].num_soft_tokens and prompt.ids.count(IDS["audio_token_id"]) == 307
    with torch.no_grad():
        inputs = hf_inputs(prompt.ids, images=images, audio=[samples], with_types=False)
        ids = inputs["input_ids"]
        inputs["mm_token_type_ids"] = (ids == IDS["image_token_id"]).long() + 3 * (ids == IDS["audio_token_id"]).long()
        want = reference(**inputs).logits.numpy()
    assert np.abs(np.array(model.logits(prompt)) - want).max() < 1e-4


def test_image_audio_and_video_commands_in_the_terminal(checkpoint, model, media, tmp_path):
    folder, _ = checkpoint
    photo, clip, video = media
    transcript = tmp_path / "chat.json"
    child = pexpect.spawn(sys.executable, ["-m", "examples.chat", "--model", str(folder), "--max-tokens", "6",
                                           "--max-soft-tokens", str(BUDGET), "--transcript", str(transcript)],
                          encoding="utf-8", timeout=300)  # fmt: skip
    child.expect("/image PATH attaches an image; /video PATH a video; /audio PATH an audio clip")
    child.expect(">> ")
    child.sendline(f"/image {photo}")
    child.expect(r"\[image attached: .*chelsea.png, \d+x\d+ px, \d+ soft tokens\]")
    child.sendline(f"/audio {clip}")
    child.expect(r"\[audio attached: .*lena.wav, 12.2\d s, 307 soft tokens\]")
    child.sendline(f"/video {video}")
    child.expect(r"\[video attached: .*carphone_pristine.mp4, 32 frames of \d+x\d+ px, \d+ soft tokens\]")
    child.expect(">> ")
    child.sendline("What do you see and hear?")
    child.expect(">> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    messages = json.loads(transcript.read_text())
    kinds = [part["type"] for part in messages[0]["content"]]
    assert kinds == ["image", "audio", "video", "text"]
    session = ChatSession(model, max_tokens=6, max_soft_tokens=BUDGET)
    expected = "".join(session.send("What do you see and hear?", images=[photo], audio=[str(clip)], videos=[str(video)]))
    assert messages[-1]["content"] == expected


def test_the_media_demo_takes_all_three(checkpoint, model, media):
    folder, _ = checkpoint
    photo, clip, video = media
    out = subprocess.run(
        [sys.executable, "-m", "examples.image_to_text", "--model", str(folder), "--image", str(photo), "--audio", str(clip),
         "--video", str(video), "--prompt", "Describe them.", "--max-soft-tokens", str(BUDGET), "--max-tokens", "6"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    session = ChatSession(model, max_tokens=6, max_soft_tokens=BUDGET)
    expected = "".join(session.send("Describe them.", images=[photo], audio=[str(clip)], videos=[str(video)]))
    assert out.stdout.rstrip("\n") == expected.rstrip("\n")
