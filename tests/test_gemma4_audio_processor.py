"""The audio processor against transformers' ``Gemma4AudioFeatureExtractor`` and ``Gemma4Processor``'s counts.

Our features are the reference extractor's (built from the checkpoint's settings), cut to the
frames its mask marks valid; what is checked is everything around it: decoding, mixing,
resampling, the valid-frame cut, the token count, the settings plumbing and the refusals.
Signals: sweeps, silence, a clipped (saturated) tone, 8 kHz and 44.1 kHz sources, stereo, and
(slow) one real recording in six containers (``tests.real_media``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from models.processing.audio import AudioDecodeError, Gemma4AudioProcessor, audio_soft_tokens, load_audio  # noqa: E402
from models.processing.settings import ProcessorSettings, ProcessorSettingsError  # noqa: E402
from tests.media_tiny import synthetic_clip  # noqa: E402

Extractor = transformers.models.gemma4.feature_extraction_gemma4.Gemma4AudioFeatureExtractor


def reference(clip: np.ndarray, **settings) -> tuple[np.ndarray, int]:
    """The reference's valid frames and ``replace_audio_token``'s count for a 16 kHz clip."""
    out = Extractor(**settings)([clip])
    features, mask = out["input_features"][0], out["input_features_mask"][0]
    count = mask
    for _ in range(2):
        count = count[::2][: (len(count) + 2 - 3) // 2 + 1]
    return features[mask], int(count.sum())


def signals() -> dict[str, np.ndarray]:
    rate = 16_000
    t = np.arange(int(2.1 * rate)) / rate
    return {
        "sweep": (0.8 * np.sin(2 * np.pi * (50 + 3900 * t / 2.1) * t)).astype(np.float32),
        "silence": np.zeros(rate, np.float32),
        "clipped": np.clip(3 * np.sin(2 * np.pi * 330 * t), -1, 1).astype(np.float32),
        "noise": np.random.default_rng(0).uniform(-1, 1, 12_345).astype(np.float32),
        "chirp": synthetic_clip(1.0),
    }


@pytest.mark.parametrize("name", sorted(signals()))
def test_features_and_counts_equal_the_reference(name):
    clip = signals()[name]
    ours = Gemma4AudioProcessor().process(clip)
    want, count = reference(clip)
    assert ours.features.shape == want.shape
    assert float(np.abs(ours.features - want).max()) <= 1e-5
    assert ours.num_soft_tokens == count == audio_soft_tokens(len(want))


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_other_rates_are_resampled_like_librosa(rate):
    """soxr "HQ" (librosa.load's default resampler), then the reference on the 16 kHz signal."""
    import soxr

    t = np.arange(int(1.5 * rate)) / rate
    source = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 2500 * t * (rate > 8000))).astype(np.float32)
    ours = Gemma4AudioProcessor().process((source, rate))
    resampled = soxr.resample(source, rate, 16_000, quality="HQ").astype(np.float32)
    want, count = reference(resampled)
    assert float(np.abs(ours.features - want).max()) <= 1e-5 and ours.num_soft_tokens == count


def test_stereo_is_averaged_and_pcm_scaled():
    left, right = signals()["sweep"], signals()["clipped"]
    mixed = Gemma4AudioProcessor().process((np.stack([left, right], axis=1), 16_000))
    want, _ = reference(((left.astype(np.float64) + right) / 2).astype(np.float32))
    assert float(np.abs(mixed.features - want).max()) <= 1e-5
    pcm = (left * 32767).astype(np.int16)
    samples, _ = load_audio((pcm, 16_000))
    assert np.allclose(samples, pcm / 32768.0)


def test_checkpoint_settings_are_used(tmp_path):
    """A checkpoint that normalises per bin gets its own features; a setting we cannot honour is refused by name."""
    mean, std = list(np.linspace(-3, 1, 128)), list(np.linspace(0.5, 2, 128))
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "per_bin_mean": mean,
                               "per_bin_stddev": std, "mel_floor": 1e-5}, "audio_seq_length": 750}))  # fmt: skip
    settings = ProcessorSettings.from_folder(tmp_path)
    assert settings.source["audio"] == "processor_config.json"
    clip = signals()["sweep"]
    ours = Gemma4AudioProcessor(settings.audio).process(clip)
    want, _ = reference(clip, per_bin_mean=mean, per_bin_stddev=std, mel_floor=1e-5)
    assert float(np.abs(ours.features - want).max()) <= 1e-5
    assert float(np.abs(ours.features - reference(clip)[0]).max()) > 0.1
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": {"feature_size": 64}}))
    with pytest.raises(ProcessorSettingsError, match="128"):
        ProcessorSettings.from_folder(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"image_mean": [0.5] * 3, "do_normalize": True}}))
    with pytest.raises(ProcessorSettingsError, match="normalisation"):
        ProcessorSettings.from_folder(tmp_path)


def test_non_audio_files_are_refused(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio\n" * 50)
    with pytest.raises(AudioDecodeError, match="notes.wav"):
        load_audio(str(text))
    with pytest.raises(AudioDecodeError, match="no such file"):
        load_audio(str(tmp_path / "missing.flac"))


@pytest.mark.slow
def test_a_real_recording_in_six_containers():
    from models.assets.fetch import AssetFetchError
    from tests.real_media import AUDIO_FILES, fetch_media

    try:
        paths = fetch_media(AUDIO_FILES)
    except AssetFetchError as exc:
        pytest.skip(f"could not download the recordings: {exc}")
    processor = Gemma4AudioProcessor()
    wav = processor.process(str(paths["lena.wav"]))
    assert wav.num_soft_tokens == 307 and abs(wav.duration - 12.27) < 0.01
    for name, path in paths.items():
        samples, _ = load_audio(str(path))
        ours = processor.process(str(path))
        want, count = reference(samples)
        assert float(np.abs(ours.features - want).max()) <= 1e-5, name
        assert ours.num_soft_tokens == count, name
    flac = processor.process(str(paths["lena.flac"]))
    # The same recording (the files differ in bit depth, so quiet bins differ in log space).
    assert float(np.abs(flac.features - wav.features).mean()) < 1e-2
