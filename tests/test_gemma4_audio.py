"""Gemma 4 audio against transformers (fp32, tiny random weights): tower, embedder, prompts, cache.

Checkpoints: ``tests.media_tiny`` (T5-shaped text with sliding window 4, the T5 vision tower, a
2-block audio tower), in two text variants: vision bidirectionality (images and video frames get
the sliding-layer overlay, audio must not) and plain causal. transformers runs its own feature
extractor's padded output with ``mm_token_type_ids``; we run ``models.load`` on the saved files.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from cache import MediaSplitError  # noqa: E402
from models.generation.generate import prefill  # noqa: E402
from models.generation.prompts import Prompt, prefill_chunks  # noqa: E402
from models.media import AudioNotSupportedError  # noqa: E402
from models.processing.audio import AudioTooLongError, EmptyAudioError, NonFiniteAudioError  # noqa: E402
from tests.hf_tiny import T5_TEXT, T5_TOKENS  # noqa: E402
from tests.media_tiny import AUDIO, IMAGE, hf_inputs, save_media_model, synthetic_clip  # noqa: E402
from tests.test_gemma4_vision_parity import synthetic_images  # noqa: E402

TOL = 1e-4
VARIANTS = {
    "vision": dict(T5_TEXT, initializer_range=0.15),
    "causal": dict(T5_TEXT, initializer_range=0.15, use_bidirectional_attention=None),
}
PROMPT_AUDIO = [2, 20, 21, AUDIO, 22, 23, 24]
PROMPT_MIXED = [2, 10, IMAGE, 11, 12, AUDIO, 13, 14, AUDIO, 15]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"audio_{request.param}")
    reference = save_media_model(directory, VARIANTS[request.param])
    return request.param, reference, models.load(str(directory), tokenizer=False)


@pytest.fixture(scope="module")
def clips():
    return [synthetic_clip(1.3, seed=1), synthetic_clip(0.77, seed=2)]


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def hf_logits(reference, prompt: Prompt, **media) -> np.ndarray:
    with torch.no_grad():
        return reference(**hf_inputs(prompt.ids, **media)).logits.numpy()


def test_audio_tower_and_embedder_equal_transformers(pair, clips):
    _, reference, model = pair
    for clip in clips:
        ours = model.encode_audio([clip])[0]
        batch = transformers.models.gemma4.feature_extraction_gemma4.Gemma4AudioFeatureExtractor()([clip], return_tensors="pt")
        with torch.no_grad():
            out = reference.model.get_audio_features(batch["input_features"], batch["input_features_mask"])
        want = out.pooler_output[0][out.attention_mask[0]].numpy()
        assert ours.shape == want.shape
        assert worst(ours, want) < 1e-5


def test_text_and_audio_logits_equal_transformers(pair, clips):
    variant, reference, model = pair
    prompt = model.prompt(PROMPT_AUDIO, audio=clips[:1])
    span = prompt.images[0]
    assert prompt.ids[span.start - 1] == T5_TOKENS["boa_token_id"] and prompt.ids[span.end] == T5_TOKENS["eoa_token_index"]
    want = hf_logits(reference, prompt, audio=clips[:1])
    assert worst(model.logits(prompt), want) < TOL
    if variant == "vision":
        # The reference keeps audio causal; marked as an image it would move: the check discriminates.
        with torch.no_grad():
            other = reference(**hf_inputs(prompt.ids, audio=clips[:1], bidirectional_types=1)).logits.numpy()
        assert worst(other, want) > 0.05


def test_text_image_and_two_clips_in_one_prompt(pair, clips):
    _, reference, model = pair
    images = synthetic_images()[:1]
    prompt = model.prompt(PROMPT_MIXED, images, 70, audio=clips)
    assert len(prompt.images) == 3
    want = hf_logits(reference, prompt, images=images, audio=clips)
    assert worst(model.logits(prompt), want) < TOL


@pytest.mark.parametrize("step", [1, 6, 17, 1000])
def test_cached_chunks_equal_one_read(pair, clips, step):
    _, _, model = pair
    images = synthetic_images()[:1]
    prompt = model.prompt(PROMPT_MIXED + [40, 41, 42], images, 70, audio=clips)
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    pieces = []
    for start, end in prefill_chunks(len(prompt.ids), prompt.images, step):
        inside = [s.features for s in prompt.images if start <= s.start < end]
        extra = {"image_features": mx.concatenate(inside)} if inside else {}
        pieces.append(np.array(model.forward(mx.array([prompt.ids[start:end]]), cache, **extra)))
    assert worst(np.concatenate(pieces, axis=1), whole) < TOL
    last = prefill(model.forward, prompt.ids, model.make_cache(), step, prompt.images)
    assert worst(last, whole[0, -1]) < TOL


def test_audio_after_cached_text_equals_a_fresh_prefill(pair, clips):
    _, _, model = pair
    prompt = model.prompt(PROMPT_AUDIO, audio=clips[:1])
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    head = Prompt(prompt.ids[:3])
    got = [np.array(model.logits(head, cache)), np.array(model.logits(prompt.suffix(3), cache))]
    assert worst(np.concatenate(got, axis=1), whole) < TOL


def test_a_read_that_cuts_an_audio_clip_is_refused_by_the_cache(pair, clips):
    _, _, model = pair
    prompt = model.prompt(PROMPT_AUDIO, audio=clips[:1])
    span = prompt.images[0]
    cut = span.start + 3
    cache = model.make_cache()
    model.forward(mx.array([prompt.ids[:cut]]), cache, image_features=span.features[:3])
    with pytest.raises(MediaSplitError, match="a span must be given in a single read"):
        model.forward(mx.array([prompt.ids[cut:]]), cache, image_features=span.features[3:])


def test_token_counts_follow_the_processor(pair):
    """ceil(ceil(frames / 2) / 2) of the valid mel frames, as Gemma4Processor.replace_audio_token."""
    _, _, model = pair
    extractor = transformers.models.gemma4.feature_extraction_gemma4.Gemma4AudioFeatureExtractor()
    for samples in (161, 321, 480, 481, 641, 16_000, 16_001, 47_999, 480_000):
        clip = synthetic_clip(samples / 16_000)[:samples]
        processed = model.process_audio([clip])[0]
        mask = extractor([clip])["input_features_mask"][0]
        for _ in range(2):
            mask = mask[::2][: (len(mask) + 2 - 3) // 2 + 1]
        assert processed.num_soft_tokens == int(mask.sum()), samples
    assert model.process_audio([synthetic_clip(30.0)])[0].num_soft_tokens == 750


def test_bad_audio_is_refused_by_name(pair):
    _, _, model = pair
    with pytest.raises(EmptyAudioError):
        model.encode_audio([np.zeros(0, np.float32)])
    with pytest.raises(EmptyAudioError, match="too short"):
        model.encode_audio([np.zeros(100, np.float32)])
    with pytest.raises(AudioTooLongError, match="split"):
        model.encode_audio([synthetic_clip(30.01)])
    with pytest.raises(NonFiniteAudioError):
        model.encode_audio([np.full(4000, np.nan, np.float32)])
    with pytest.raises(ValueError, match="1 audio clip placeholder"):
        model.prompt(PROMPT_AUDIO, audio=[synthetic_clip(0.5), synthetic_clip(0.5)])
    with pytest.raises(ValueError, match="no audio was given"):
        model.prompt(PROMPT_AUDIO)


def test_audio_to_a_model_without_an_audio_tower_is_refused(tmp_path):
    save_media_model(tmp_path, VARIANTS["causal"], audio=False)
    model = models.load(str(tmp_path), tokenizer=False)
    assert model.supports_images and not model.supports_audio
    with pytest.raises(AudioNotSupportedError, match="no audio tower"):
        model.prompt(PROMPT_AUDIO, audio=[synthetic_clip(0.5)])


def test_chat_turns_with_audio_and_a_bad_clip_leave_the_session_unchanged(pair, clips, tmp_path):
    """ChatSession.send(audio=...) keeps the clip's features for later turns; a bad file or an
    over-long clip is refused by name before anything changes (history, features, cache)."""
    from models.generation.chat import ChatSession

    _, _, model = pair

    def render(messages=None):  # no tokenizer on the tiny model: one fixed text token per turn, then placeholders
        ids = [2]
        for message in messages or session.messages:
            content = message["content"]
            items = content if isinstance(content, list) else [{"type": "text"}]
            ids += [AUDIO if item["type"] == "audio" else IMAGE if item["type"] == "image" else 40 for item in items] + [41]
        return ids

    session = ChatSession(model, max_tokens=3)
    session.render = render
    list(session.send("hello", audio=[clips[0]]))
    assert len(session.audio_features) == 1 and session.fed_images
    fed, messages = list(session.fed), list(session.messages)
    bad = tmp_path / "bad.wav"
    bad.write_text("not audio")
    with pytest.raises(ValueError):
        list(session.send("again", audio=[str(bad)]))
    with pytest.raises(AudioTooLongError):
        list(session.send("again", audio=[synthetic_clip(31.0)]))
    assert session.fed == fed and session.messages == messages and len(session.audio_features) == 1
    span = session.fed_images[0]
    list(session.send("more"))  # the kept clip is re-expanded from its features, not re-encoded
    assert len(session.audio_features) == 1 and session.fed_images[0].features is span.features
    assert (session.fed_images[0].start, session.fed_images[0].end) == (span.start, span.end)
